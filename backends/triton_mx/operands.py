"""Operands per recipe: quantize high-precision inputs with ``gg.quantize_mx``, or check
pre-quantized ``MXTensor`` operands, so the kernels always see MX data blocked along the
contraction (fwd / dgrad) or along the tokens (wgrad). The Hopper upcast path takes its
weight in its own layout (``upcast_weight``): high-precision weights are quantized
straight into it, with no ``MXTensor`` in between.

Which format goes where (docs/mx_formats.md "Recipes and operands", recipes.py):

==========  ==================  =======================  ========================
recipe      fwd x (along K)     dgrad dy (along N)       w (fwd: along K; dgrad: N)
==========  ==================  =======================  ========================
mxfp8       E4M3                grad_format (E4M3)       E4M3
mxfp4       E2M1                grad_format (E2M1)       E2M1
a8w4        E4M3                grad_format (E4M3)       E2M1
a16w4       bf16, unquantized   bf16, unquantized        E2M1
==========  ==================  =======================  ========================

wgrad (mxfp4, mxfp8): dy quantized to grad_format and x to the activation format along
the tokens, each group's rows padded to a multiple of 32 so no block straddles two groups
(``gg.quantize_mx_rows``). Where the product runs on the exact bf16 decodes (sm_90), the
quantization and the decode are one pass that keeps the rows in place (``wgrad_decoded``):
the padding is only where the blocks start, never in memory. a8w4's wgrad (E4M3 x E4M3)
and a16w4's (bf16 x bf16) have no E2M1 operand and are left to other backends
(``triton_mxfp4``'s check says so).
"""

from __future__ import annotations

import torch

from grouped_gemm.backends.triton_mx import launch, layouts, layouts_e4m3
from grouped_gemm.backends.triton_mx.layouts import UpcastWeight
from grouped_gemm.errors import InvalidArgumentError
from grouped_gemm.mx import MXTensor, padded_row_offsets, quantize_mx, quantize_mx_rows, quantize_mx_weight
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


def decoded_activation(problem: Problem, a: torch.Tensor | MXTensor, name: str) -> torch.Tensor:
    """fwd's x or dgrad's dy as the sm_90 upcast kernel takes it: bf16 values on the
    recipe's MX grid (an MXTensor decoded; a high-precision tensor quantized and decoded
    in one pass), or the bf16 tensor itself for a16w4."""
    fmt = lhs_format(problem)
    if isinstance(a, MXTensor):
        return launch.dequantize(activation(problem, a, name))
    if fmt is None:
        return a
    return launch.quantize_decode(a, fmt, problem.scale_rule)


def activation_quantizer(problem: Problem, a: torch.Tensor | MXTensor) -> tuple[str, str] | None:
    """(format, scale rule) with which the sm_90 upcast launch quantizes and decodes fwd's x
    / dgrad's dy itself (``launch.launch_upcast``): a bf16 tensor under a recipe that
    quantizes it. None otherwise: ``decoded_activation`` prepares it."""
    fmt = lhs_format(problem)
    if fmt is None or type(a) is not torch.Tensor or a.dtype != torch.bfloat16:
        return None
    return fmt, problem.scale_rule


def weight(problem: Problem, w: torch.Tensor | MXTensor, fmt: str | None = None) -> MXTensor:
    """The (G, N, K) weight in the recipe's format (E2M1 or E4M3; ``fmt``, where the caller
    has it already) blocked along K (fwd) or N (dgrad)."""
    axis = 2 if problem.op == "fwd" else 1
    fmt = fmt or get_recipe(problem.recipe).weight_format
    if isinstance(w, MXTensor):
        if w.fmt != fmt or w.ndim != 3 or w.axis != axis or w.pad or w.block_size != BLOCK:
            raise InvalidArgumentError(
                "w",
                w,
                f"a (G, N, K) {fmt} MXTensor with blocks of {BLOCK} along axis {axis} "
                f"({'K' if axis == 2 else 'N'}, the {problem.op} contraction), no padding",
            )
        return w
    return quantize_mx_weight(w, fmt, op=problem.op, scale_rule=problem.scale_rule)


def upcast_weight(problem: Problem, w: torch.Tensor | MXTensor) -> UpcastWeight:
    """The weight in the Hopper upcast kernel's layout. High-precision weights (training:
    new every step) are quantized straight into it by one fused kernel, with nothing read
    back to the host, so this is safe inside a CUDA graph and re-runs on replay; an
    ``MXTensor`` is its owner's fixed copy, and its layout is cached per object."""
    fmt = get_recipe(problem.recipe).weight_format
    if not isinstance(w, MXTensor):
        return layouts.quantize_upcast_weight(w, problem.op, problem.scale_rule, fmt=fmt)
    if fmt == "e4m3":
        return layouts_e4m3.upcast_weight_e4m3(weight(problem, w, fmt))
    return layouts.upcast_weight(weight(problem, w, fmt))


def wgrad_operands(
    problem: Problem, dy: torch.Tensor, x: torch.Tensor, m_splits: list[int] | torch.Tensor
) -> tuple[MXTensor, MXTensor, torch.Tensor]:
    """dy (grad_format) and x (the recipe's activation format) quantized along the tokens,
    each group padded to 32 rows (``gg.quantize_mx_rows``), and the padded cumulative group
    ends (G,) int32."""
    x_format = get_recipe(problem.recipe).act_format
    dy_rows = quantize_mx_rows(dy, m_splits, problem.grad_format, align=BLOCK, scale_rule=problem.scale_rule)
    x_rows = quantize_mx_rows(x, m_splits, x_format, align=BLOCK, scale_rule=problem.scale_rule)
    return dy_rows.tensor, x_rows.tensor, dy_rows.padded_offsets[1:]


def wgrad_decoded(
    problem: Problem, dy: torch.Tensor, x: torch.Tensor, m_splits: list[int] | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``wgrad_operands`` decoded to bf16 in the inputs' own (tight) rows, and the tight
    cumulative group ends (G,) int32: bit for bit the decodes of ``wgrad_operands`` with
    their padding rows dropped, in two quantize-and-decode passes that share one group
    table (``gg.mx.padded_row_offsets``)."""
    x_format = get_recipe(problem.recipe).act_format
    starts, padded_starts, padded_rows = padded_row_offsets(m_splits, dy.shape[0], dy.device, BLOCK)
    rule = problem.scale_rule
    dy_b = launch.quantize_decode_rows(dy, starts, padded_starts, padded_rows, problem.grad_format, rule)
    x_b = launch.quantize_decode_rows(x, starts, padded_starts, padded_rows, x_format, rule)
    return dy_b, x_b, starts[1:]
