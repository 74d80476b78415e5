"""Pre-quantized MX weights for ``--prequantized-weights``, when ``gg.quantize_mx`` exists.

A weight is quantized along the contraction dimension of its op: K for fwd, N for
dgrad. Timing pre-quantized weights shows a kernel without the weight cast, as in
inference or when weights are cast once per optimizer step.
"""

from __future__ import annotations

from typing import Any

import torch

import grouped_gemm as gg
from grouped_gemm.problem import Op


def unavailable(recipe: str, op: Op) -> str | None:
    """None when the weight of ``op`` (fwd or dgrad) under ``recipe`` can be pre-quantized
    here, else why not."""
    fmt = gg.get_recipe(recipe).weight_format
    if fmt is None:
        return f"recipe {recipe} keeps weights in high precision"
    if not callable(getattr(gg, "quantize_mx", None)):
        return "this grouped_gemm has no gg.quantize_mx, so weights cannot be pre-quantized"
    return None


def quantize_weight(w: torch.Tensor, recipe: str, op: Op) -> Any:
    """``w`` (G, N, K) as an MXTensor in the recipe's weight format, blocked along the
    op's contraction dimension, with the recipe's scale rule."""
    resolved = gg.get_recipe(recipe)
    axis = -1 if op == "fwd" else -2
    return gg.quantize_mx(w, resolved.weight_format, axis=axis, scale_rule=resolved.scale_rule)


def dequantized(q: Any, like: torch.Tensor) -> torch.Tensor:
    """The values an MXTensor stands for, for the float64 reference (``like``'s shape)."""
    values = q.dequantize()
    if tuple(values.shape) != tuple(like.shape):
        raise ValueError(f"dequantized weight has shape {tuple(values.shape)}, expected {tuple(like.shape)}")
    return values
