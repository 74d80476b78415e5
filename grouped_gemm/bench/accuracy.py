"""A float64 reference on a sample of the output, so big benchmark shapes stay affordable.

Each checked group contributes its first and last rows (where offset bugs show) and
random rows between; groups checked are the first and last non-empty ones, the largest,
and a random one (wgrad adds an empty group, whose dw must be zero, and samples rows of
N instead, since each dw_g needs all of the group's tokens). The SQNR of the backend's
output against float64 on those entries is compared with ``grouped_gemm.check`` floors.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from grouped_gemm.problem import Op
from grouped_gemm.testing import sqnr_db

#: Rows taken from each end of a sampled group, and random rows between them.
EDGE_ROWS = 16
RANDOM_ROWS = 32


@dataclasses.dataclass(frozen=True)
class Sample:
    """Which output entries are checked, and their float64 values.

    fwd / dgrad: ``rows`` of the ``(M, cols)`` output. wgrad: ``groups`` x ``rows`` of N
    of the ``(G, N, K)`` output.
    """

    op: Op
    rows: torch.Tensor
    groups: torch.Tensor | None
    expected: torch.Tensor

    def actual(self, out: torch.Tensor) -> torch.Tensor:
        """The sampled entries of a backend's output."""
        if self.op == "wgrad":
            return out[self.groups][:, self.rows]
        return out[self.rows]

    def sqnr(self, out: torch.Tensor) -> float:
        return sqnr_db(self.actual(out), self.expected)


def _pick(count: int, gen: torch.Generator) -> list[int]:
    """Edge rows and random rows of a range of ``count``, sorted, without repeats."""
    edges = set(range(min(EDGE_ROWS, count))) | set(range(max(0, count - EDGE_ROWS), count))
    inner = torch.randint(0, count, (RANDOM_ROWS,), generator=gen).tolist() if count else []
    return sorted(edges | set(inner))


def _groups(splits: list[int], gen: torch.Generator, want_empty: bool) -> list[int]:
    live = [g for g, rows in enumerate(splits) if rows]
    chosen = set()
    if live:
        chosen |= {live[0], live[-1], max(live, key=lambda g: splits[g])}
        chosen.add(live[int(torch.randint(0, len(live), (1,), generator=gen))])
    empty = [g for g, rows in enumerate(splits) if not rows]
    if want_empty and empty:
        chosen.add(empty[0])
    return sorted(chosen)


def sample_reference(op: Op, a: torch.Tensor, b: torch.Tensor, splits: list[int], seed: int = 0) -> Sample:
    """Float64 values of a sample of ``op(a, b)``; ``b`` is the weight (fwd, dgrad) or x
    (wgrad), in high precision (dequantize pre-quantized weights first)."""
    gen = torch.Generator().manual_seed(seed)
    device = a.device
    starts = [0, *itertools.accumulate(splits)]
    groups = _groups(splits, gen, want_empty=op == "wgrad")
    if op == "wgrad":
        rows = _pick(a.shape[1], gen)
        blocks = []
        for g in groups:
            dy_g = a[starts[g] : starts[g + 1], rows].double()
            blocks.append(dy_g.T @ b[starts[g] : starts[g + 1]].double())
        expected = torch.stack(blocks) if blocks else torch.zeros(0, len(rows), b.shape[1], dtype=torch.float64)
        index = torch.tensor(rows, dtype=torch.long, device=device)
        return Sample(op, index, torch.tensor(groups, dtype=torch.long, device=device), expected.to(device))
    picked, blocks = [], []
    for g in groups:
        local = [starts[g] + r for r in _pick(splits[g], gen)]
        w_g = b[g].double()
        blocks.append(a[local].double() @ (w_g.T if op == "fwd" else w_g))
        picked += local
    cols = b.shape[1] if op == "fwd" else b.shape[2]
    expected = torch.cat(blocks) if blocks else torch.zeros(0, cols, dtype=torch.float64, device=device)
    return Sample(op, torch.tensor(picked, dtype=torch.long, device=device), None, expected)
