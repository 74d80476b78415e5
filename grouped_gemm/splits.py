"""Split generators for described problems, benchmarks and tests.

The rules are those of the project's ``moe_shapes.json`` so that every tool builds the
same splits for a case: balanced puts the remainder on the last group; skewed draws
``u = rand(G) ** 3 + 1e-3`` from a seeded generator and floors ``u / sum(u) * M``,
adding what is left to group 0.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from grouped_gemm.errors import InvalidArgumentError, InvalidTypeError

_GROUPS = "an int >= 1"
_ROWS = "an int >= 0"
_SKEWED_ROWS = "an int in [0, 2**53] (the sizes are drawn in float64, exact up to 2**53)"
#: The seeds ``torch.Generator.manual_seed`` takes (both ends included).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
_SEED = "an int in [-2**63, 2**64) (a torch.Generator seed)"


def _int(name: str, value: Any, allowed: str, low: int, high: int | None = None) -> int:
    """``value`` as a Python int in ``[low, high]`` (numpy ints too): a float or bool would
    give float or wrong sizes, a bad count a ZeroDivisionError or IndexError."""
    if isinstance(value, (bool, float)):
        raise InvalidTypeError(name, value, allowed)
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidTypeError(name, value, allowed) from None
    if number < low or (high is not None and number > high):
        raise InvalidArgumentError(name, value, allowed)
    return number


def balanced_splits(groups: int, m: int) -> list[int]:
    """``M // G`` rows per group, the remainder on the last group."""
    groups, m = _int("groups", groups, _GROUPS, 1), _int("m", m, _ROWS, 0)
    base = m // groups
    splits = [base] * groups
    splits[-1] += m - base * groups
    return splits


def skewed_splits(groups: int, m: int, seed: int = 0) -> list[int]:
    """Heavy-tailed group sizes (most rows in a few experts), deterministic per seed."""
    groups, m = _int("groups", groups, _GROUPS, 1), _int("m", m, _SKEWED_ROWS, 0, 2**53)
    seed = _int("seed", seed, _SEED, SEED_MIN, SEED_MAX)
    # On the CPU, like its generator: under a GPU or meta default device torch.rand failed
    # (a CPU generator there, or no values to read back).
    generator = torch.Generator().manual_seed(seed)
    u = torch.rand(groups, generator=generator, dtype=torch.float64, device="cpu") ** 3 + 1e-3
    sizes = torch.floor(u / u.sum() * m).to(torch.int64)
    sizes[0] += m - int(sizes.sum())
    return [int(s) for s in sizes.tolist()]
