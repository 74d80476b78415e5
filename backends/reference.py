"""Backend ``reference``: one torch matmul per group in fp32, the ground truth.

Runs every op on any device, slowly: each group's operands are upcast to fp32, multiplied
(fp32 accumulation), and the result cast to the output dtype. When torch is allowed to
use TF32 for fp32 matmuls, it computes in float64 instead, so it stays exact.

MX recipes quantize each operand as the recipe says, dequantize, and multiply the same
way, with blocks along each op's contraction dimension:

======  =====================================  ======================================
op      a                                      b
======  =====================================  ======================================
fwd     x along K, ``act_format``              w along K, ``weight_format``
dgrad   dy along N, ``grad_format``            w along N, ``weight_format``
wgrad   dy along M per group, ``grad_format``  x along M per group, ``act_format``
======  =====================================  ======================================

A format of None (a16w4's activations and gradients) keeps that operand as it is.
Contraction lengths that are not block multiples are zero-padded; wgrad pads each group's
rows to a multiple of 32. Pre-quantized ``MXTensor`` operands are used as given.
"""

from __future__ import annotations

import torch

from grouped_gemm import Backend, BackendSpec, GroupedInputs, MXTensor, Problem, __version__, get_recipe, hookimpl
from grouped_gemm.errors import ShapeError
from grouped_gemm.mx import quantize_mx, quantize_mx_rows


def _accumulate_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        return torch.float64
    return torch.float32


class ReferenceBackend(Backend):
    """Per-group fp32 torch matmuls; host splits (one sync if they are on the device)."""

    spec = BackendSpec(
        name="reference",
        version=__version__,
        description="per-group fp32 torch matmul; the ground truth, slow",
        ops=frozenset({"fwd", "dgrad", "wgrad"}),
        recipes=frozenset({"bf16", "fp16", "fp32", "mxfp8", "mxfp4", "a8w4", "a16w4"}),
        vendors=frozenset({"cpu", "cuda", "rocm"}),
        mx_formats=frozenset({"e4m3", "e5m2", "e2m1"}),
        host_splits=True,
        weight_list=True,
        priority=0,
    )

    def run(self, problem: Problem, inputs: GroupedInputs) -> torch.Tensor | list[torch.Tensor]:
        splits = inputs.splits_list()
        if problem.op == "wgrad":
            return self._wgrad(problem, inputs, splits)
        a, w = inputs.a, inputs.b
        if problem.recipe not in _PLAIN:
            a, w = _mx_operands(problem, a, w, _accumulate_dtype(a.device))
        out = inputs.output(problem)
        acc = _accumulate_dtype(a.device)
        start = 0
        for g, rows in enumerate(splits):
            if rows:
                w_g = w[g].to(acc)
                a_g = a[start : start + rows].to(acc)
                out[start : start + rows] = a_g @ (w_g.T if problem.op == "fwd" else w_g)
            start += rows
        return out

    def _wgrad(self, problem: Problem, inputs: GroupedInputs, splits: list[int]) -> torch.Tensor | list[torch.Tensor]:
        dy, x = inputs.a, inputs.b
        if problem.recipe not in _PLAIN:
            dy, x = _mx_wgrad_operands(problem, dy, x, splits, _accumulate_dtype(dy.device))
        out = inputs.output(problem)
        acc = _accumulate_dtype(dy.device)
        start = 0
        for g, rows in enumerate(splits):
            target = out[g]
            if rows:
                grad = dy[start : start + rows].to(acc).T @ x[start : start + rows].to(acc)
                if problem.accumulate:
                    grad += target.to(acc)
                target.copy_(grad)
            elif not problem.accumulate:
                target.zero_()
            start += rows
        return out


_PLAIN = frozenset({"bf16", "fp16", "fp32"})


def _formats(problem: Problem) -> tuple[str | None, str | None]:
    """The recipe's (a, b) element formats for this op; None keeps an operand as it is."""
    recipe = get_recipe(problem.recipe)
    if problem.op == "fwd":
        return recipe.act_format, recipe.weight_format
    if problem.op == "dgrad":
        return problem.grad_format, recipe.weight_format
    return problem.grad_format, recipe.act_format


def _dequantized(t: torch.Tensor | MXTensor, fmt: str | None, axis: int, rule: str, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as the recipe sees it, in ``dtype``: MXTensors as given, others quantized
    along ``axis`` (zero-padded to whole blocks) and dequantized, or kept when ``fmt`` is None."""
    if isinstance(t, MXTensor):
        return t.dequantize(dtype)
    if fmt is None:
        return t.to(dtype)
    return quantize_mx(t, fmt, axis=axis, scale_rule=rule, pad=True).dequantize(dtype)


def _mx_operands(
    problem: Problem, a: torch.Tensor | MXTensor, w: torch.Tensor | list[torch.Tensor] | MXTensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """fwd: x and w along K; dgrad: dy and w along N."""
    a_fmt, w_fmt = _formats(problem)
    if isinstance(w, list):
        w = torch.stack(w)
    w_axis = 2 if problem.op == "fwd" else 1
    return (
        _dequantized(a, a_fmt, 1, problem.scale_rule, dtype),
        _dequantized(w, w_fmt, w_axis, problem.scale_rule, dtype),
    )


def _rows(
    t: torch.Tensor | MXTensor, fmt: str | None, splits: list[int], rule: str, dtype: torch.dtype
) -> torch.Tensor:
    """wgrad's dy or x along M, each group's rows zero-padded to whole blocks."""
    if isinstance(t, MXTensor):
        bad = next((s for s in splits if s % t.block_size), None)
        if bad is not None:
            raise ShapeError("m_splits", splits, f"multiples of {t.block_size} for MXTensor operands blocked along M")
        return t.dequantize(dtype)
    if fmt is None:
        return t.to(dtype)
    return quantize_mx_rows(t, splits, fmt, scale_rule=rule).dequantize(dtype)


def _mx_wgrad_operands(
    problem: Problem, dy: torch.Tensor | MXTensor, x: torch.Tensor | MXTensor, splits: list[int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    dy_fmt, x_fmt = _formats(problem)
    return _rows(dy, dy_fmt, splits, problem.scale_rule, dtype), _rows(x, x_fmt, splits, problem.scale_rule, dtype)


@hookimpl
def grouped_gemm_backends() -> list[Backend]:
    return [ReferenceBackend()]
