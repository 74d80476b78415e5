"""Numerics shared by tests, ``grouped-gemm check`` and the benchmarks.

Float64 ground truth for each op, error measures, poisoned outputs, and random problem
data that is never zeros (zeros hide unwritten outputs and wrong indexing).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

#: A value no correct kernel writes; ``poison`` fills outputs with it before a run.
POISON = float("nan")


def sqnr_db(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``10 log10(|ref|^2 / |out - ref|^2)``.

    NaN or Inf anywhere in ``actual`` gives ``-inf``; an exact match gives ``inf``.
    """
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    if not torch.isfinite(a).all():
        return -math.inf
    noise = torch.sum((a - e) ** 2).item()
    signal = torch.sum(e**2).item()
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (inf for NaN/Inf outputs)."""
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    if not torch.isfinite(a).all():
        return math.inf
    denom = torch.linalg.vector_norm(e).item()
    diff = torch.linalg.vector_norm(a - e).item()
    return diff if denom == 0.0 else diff / denom


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with NaN in place (so a row a kernel forgot shows up) and return it."""
    return t.fill_(POISON)


def _groups(w: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return list(w) if not isinstance(w, torch.Tensor) else list(w.unbind(0))


def ref_fwd(x: torch.Tensor, w: torch.Tensor | Sequence[torch.Tensor], splits: Sequence[int]) -> torch.Tensor:
    """Float64 ``out_g = x_g @ w_g^T``."""
    ws = _groups(w)
    out = torch.zeros(x.shape[0], ws[0].shape[0], dtype=torch.float64, device=x.device)
    start = 0
    for g, rows in enumerate(splits):
        out[start : start + rows] = x[start : start + rows].double() @ ws[g].double().T
        start += rows
    return out


def ref_dgrad(dy: torch.Tensor, w: torch.Tensor | Sequence[torch.Tensor], splits: Sequence[int]) -> torch.Tensor:
    """Float64 ``dx_g = dy_g @ w_g``."""
    ws = _groups(w)
    out = torch.zeros(dy.shape[0], ws[0].shape[1], dtype=torch.float64, device=dy.device)
    start = 0
    for g, rows in enumerate(splits):
        out[start : start + rows] = dy[start : start + rows].double() @ ws[g].double()
        start += rows
    return out


def ref_wgrad(dy: torch.Tensor, x: torch.Tensor, splits: Sequence[int]) -> torch.Tensor:
    """Float64 ``dw_g = dy_g^T @ x_g`` (zeros for empty groups)."""
    out = torch.zeros(len(splits), dy.shape[1], x.shape[1], dtype=torch.float64, device=dy.device)
    start = 0
    for g, rows in enumerate(splits):
        out[g] = dy[start : start + rows].double().T @ x[start : start + rows].double()
        start += rows
    return out


def random_splits(groups: int, m: int, *, empty: int = 0, generator: torch.Generator | None = None) -> list[int]:
    """Random non-negative sizes summing to ``m`` with at least ``empty`` zero groups."""
    if empty >= groups and m:
        raise ValueError(f"cannot place m={m} rows with all {groups} groups empty")
    weights = torch.rand(groups, generator=generator, dtype=torch.float64) ** 2 + 1e-3
    weights[torch.randperm(groups, generator=generator)[:empty]] = 0.0
    sizes = torch.floor(weights / weights.sum() * m).to(torch.int64)
    live = torch.nonzero(weights).flatten()
    sizes[live[0]] += m - int(sizes.sum())
    return [int(s) for s in sizes.tolist()]
