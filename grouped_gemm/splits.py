"""Split generators for described problems, benchmarks and tests.

The rules are those of the project's ``moe_shapes.json`` so that every tool builds the
same splits for a case: balanced puts the remainder on the last group; skewed draws
``u = rand(G) ** 3 + 1e-3`` from a seeded generator and floors ``u / sum(u) * M``,
adding what is left to group 0.
"""

from __future__ import annotations

import torch


def balanced_splits(groups: int, m: int) -> list[int]:
    """``M // G`` rows per group, the remainder on the last group."""
    base = m // groups
    splits = [base] * groups
    splits[-1] += m - base * groups
    return splits


def skewed_splits(groups: int, m: int, seed: int = 0) -> list[int]:
    """Heavy-tailed group sizes (most rows in a few experts), deterministic per seed."""
    u = torch.rand(groups, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) ** 3 + 1e-3
    sizes = torch.floor(u / u.sum() * m).to(torch.int64)
    sizes[0] += m - int(sizes.sum())
    return [int(s) for s in sizes.tolist()]
