"""Operands per recipe: quantize high-precision inputs with ``gg.quantize_mx``, or check
pre-quantized ``MXTensor`` operands, so the kernels always see MX data blocked along the
contraction (fwd / dgrad) or along the tokens (wgrad).

Which format goes where (DESIGN section 2, recipes.py):

==========  ==================  =======================  ========================
recipe      fwd x (along K)     dgrad dy (along N)       w (fwd: along K; dgrad: N)
==========  ==================  =======================  ========================
mxfp4       E2M1                grad_format (E2M1)       E2M1
a8w4        E4M3                grad_format (E4M3)       E2M1
a16w4       bf16, unquantized   bf16, unquantized        E2M1
==========  ==================  =======================  ========================

wgrad (mxfp4 only): dy and x quantized to E2M1 along the tokens, each group's rows padded
to a multiple of 32 so no block straddles two groups.
"""

from __future__ import annotations

import torch

from grouped_gemm.errors import InvalidArgumentError, ShapeError
from grouped_gemm.mx import MXTensor, quantize_mx
from grouped_gemm.problem import Problem
from grouped_gemm.recipes import get_recipe

BLOCK = 32


def lhs_format(problem: Problem) -> str | None:
    """The MX format of fwd's x / dgrad's dy under the problem's recipe (None: unquantized)."""
    if problem.op == "fwd":
        return get_recipe(problem.recipe).act_format
    return problem.grad_format


def activation(problem: Problem, a: torch.Tensor | MXTensor, name: str) -> torch.Tensor | MXTensor:
    """fwd's x or dgrad's dy as the kernels take it: an MXTensor blocked along its last
    axis, or the bf16 tensor itself for a16w4."""
    fmt = lhs_format(problem)
    if isinstance(a, MXTensor):
        if a.fmt != fmt or a.axis != a.ndim - 1 or a.ndim != 2 or a.pad or a.block_size != BLOCK:
            raise InvalidArgumentError(
                name,
                a,
                f"an MXTensor of format {fmt}, blocks of {BLOCK} along its last axis (the contraction), no padding",
            )
        return a
    if fmt is None:
        return a
    return quantize_mx(a, fmt, axis=-1, scale_rule=problem.scale_rule)


def weight(problem: Problem, w: torch.Tensor | MXTensor) -> MXTensor:
    """The (G, N, K) E2M1 weight blocked along K (fwd) or N (dgrad)."""
    axis = 2 if problem.op == "fwd" else 1
    if isinstance(w, MXTensor):
        if w.fmt != "e2m1" or w.ndim != 3 or w.axis != axis or w.pad or w.block_size != BLOCK:
            raise InvalidArgumentError(
                "w",
                w,
                f"a (G, N, K) e2m1 MXTensor with blocks of {BLOCK} along axis {axis} "
                f"({'K' if axis == 2 else 'N'}, the {problem.op} contraction), no padding",
            )
        return w
    return quantize_mx(w, "e2m1", axis=axis, scale_rule=problem.scale_rule)


def padded_token_layout(t: torch.Tensor, ends: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows of ``t`` regrouped so each group starts at a multiple of 32 with zero rows
    between groups, padded cumulative group ends). Device-side only: no host sync.

    The buffer has ``32 * (ceil(M / 32) + G)`` rows, enough for any splits; rows past the
    last group stay zero.
    """
    m = t.shape[0]
    capacity = BLOCK * (-(-m // BLOCK) + groups)
    padded = torch.zeros(capacity, t.shape[1], dtype=t.dtype, device=t.device)
    ends64 = ends.to(torch.int64)
    starts = ends64 - torch.diff(ends64, prepend=ends64.new_zeros(1))
    padded_rows = (ends64 - starts + BLOCK - 1) // BLOCK * BLOCK
    padded_ends = torch.cumsum(padded_rows, 0)
    if m:
        row = torch.arange(m, device=t.device)
        group = torch.searchsorted(ends64, row, right=True)
        dest = row - starts[group] + (padded_ends - padded_rows)[group]
        padded.index_copy_(0, dest, t)
    return padded, padded_ends.to(torch.int32)


def wgrad_operands(
    problem: Problem, dy: torch.Tensor, x: torch.Tensor, ends: torch.Tensor
) -> tuple[MXTensor, MXTensor, torch.Tensor]:
    """dy and x quantized to E2M1 along the tokens in the padded token layout, and the
    padded group ends."""
    if dy.shape[0] != x.shape[0]:
        raise ShapeError("x", x, f"{dy.shape[0]} rows, like dy")
    dy_padded, padded_ends = padded_token_layout(dy, ends, problem.groups)
    x_padded, _ = padded_token_layout(x, ends, problem.groups)
    fmt = problem.grad_format or "e2m1"
    dy_q = quantize_mx(dy_padded, fmt, axis=0, scale_rule=problem.scale_rule)
    x_q = quantize_mx(x_padded, "e2m1", axis=0, scale_rule=problem.scale_rule)
    return dy_q, x_q, padded_ends
