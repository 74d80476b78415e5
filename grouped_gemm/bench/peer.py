"""The peer: ``torch._grouped_mm`` in bf16, called directly (not through any backend).

Measured in its best form -- group ends precomputed on the device, operands passed as
views -- so the ratio against it does not depend on this project's code:

- fwd:   ``_grouped_mm(x, w.transpose(-2, -1), offs)``     -> (M, N)
- dgrad: ``_grouped_mm(dy, w, offs)``                      -> (M, K)
- wgrad: ``_grouped_mm(dy.t(), x, offs)`` (offs split M)    -> (G, N, K)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from grouped_gemm.bench.operands import Operands
from grouped_gemm.problem import Op

NAME = "torch._grouped_mm"


def available() -> str | None:
    """None when this torch has ``_grouped_mm``, else why not."""
    return None if hasattr(torch, "_grouped_mm") else f"torch {torch.__version__} has no torch._grouped_mm"


def group_ends(splits: list[int], device: torch.device) -> torch.Tensor:
    """Cumulative group ends as int32 on the device, as ``_grouped_mm`` takes them."""
    return torch.tensor(list(itertools.accumulate(splits)), dtype=torch.int32, device=device)


def call(op: Op, operands: Operands, offs: torch.Tensor) -> torch.Tensor:
    """One peer call on bf16 operands laid out as ``Problem`` describes them."""
    a, b = operands.a, operands.b
    if op == "fwd":
        return torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
    if op == "dgrad":
        return torch._grouped_mm(a, b, offs=offs)
    return torch._grouped_mm(a.t(), b, offs=offs)


def runner(op: Op, sets: list[Operands], offs: torch.Tensor) -> Callable[[int], torch.Tensor]:
    """``fn(i)``: the peer on operand set ``i``."""
    return lambda i: call(op, sets[i], offs)
