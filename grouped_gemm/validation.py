"""Input validation: user arguments -> (Problem, GroupedInputs), or a clear error.

Every check that needs no device-to-host sync is done on every call. Splits that live
on the device are checked for dtype, rank and length only; their sum and signs can be
asserted on the device (``configure(check_device_splits=True)``), asynchronously.
Operands that are pre-quantized MXTensors are handed to ``validation_mx``.
"""

from __future__ import annotations

from typing import Any

import torch

from grouped_gemm.arguments import (
    all_contiguous,
    check_operand_kind,
    check_out,
    check_tensor,
    dtype_name,
    group_count,
    intern_problem,
    out_dtype_name,
    plain_recipe,
    same_device,
    splits_operand,
    weight_operand,
    wgrad_out,
)
from grouped_gemm.errors import InvalidTypeError, ShapeError
from grouped_gemm.group_offsets import ends_cache
from grouped_gemm.inputs import GroupedInputs
from grouped_gemm.mx import MXTensor
from grouped_gemm.problem import Op, Problem
from grouped_gemm.recipes import Recipe
from grouped_gemm.validation_mx import (
    check_row_blocks,
    default_out_dtype,
    mx_contiguous,
    mx_fwd_or_dgrad,
    mx_operand,
    mx_recipe,
    operand_format,
)

__all__ = ["dtype_name", "fwd_or_dgrad", "wgrad"]

_STRIDED = torch.strided


def fwd_or_dgrad(
    op: Op,
    a: Any,
    w: Any,
    m_splits: Any,
    recipe: str | Recipe | None,
    out: Any,
    out_dtype: torch.dtype | None,
) -> tuple[Problem, GroupedInputs]:
    """Validate ``fwd`` (a = x, (M, K)) or ``dgrad`` (a = dy, (M, N)) arguments.

    Written flat on purpose: it runs on every call, and each helper call costs time
    the dispatch-overhead budget (a few microseconds) does not have.
    """
    fwd = op == "fwd"
    a_arg = "x" if fwd else "dy"
    if not isinstance(a, torch.Tensor) or a.dim() != 2:
        if isinstance(a, MXTensor):
            return mx_fwd_or_dgrad(op, a, w, m_splits, recipe, out, out_dtype)
        check_tensor(a, a_arg, 2, "(M, K)" if fwd else "(M, N)")
    if isinstance(w, torch.Tensor) and w.dim() == 3:
        groups, n, k = w.shape
        is_list = False
        w0 = w
        if groups < 1:
            weight_operand(w, "w")
    else:
        if isinstance(w, MXTensor):
            return mx_fwd_or_dgrad(op, a, w, m_splits, recipe, out, out_dtype)
        w, groups, n, k, is_list = weight_operand(w, "w")
        w0 = w[0]
    if a.requires_grad or w0.requires_grad or a.layout is not _STRIDED or w0.layout is not _STRIDED:
        check_operand_kind([(a_arg, a), *(("w", t) for t in (w if is_list else [w]))])
    m, inner = a.shape
    if inner != (k if fwd else n):
        dims = "(M, K) with K" if fwd else "(M, N) with N"
        raise ShapeError(a_arg, a, f"{dims}={k if fwd else n} to match w {(groups, n, k)}")
    device = a.device
    if w0.device != device:
        same_device(device, "w", w0)
    if device.type == "meta":
        check_operand_kind([(a_arg, a)])
    if isinstance(m_splits, list) and len(m_splits) == groups:
        try:
            lowest = min(m_splits)
            total = sum(m_splits)
        except (TypeError, ValueError, RuntimeError):  # e.g. a multi-element tensor among them
            lowest = total = None
        if type(total) is int and type(lowest) is int and lowest >= 0 and total == m:
            splits, host = tuple(m_splits), True
        else:
            splits, host = splits_operand(m_splits, groups, m, a_arg, device)
    else:
        splits, host = splits_operand(m_splits, groups, m, a_arg, device)
    resolved = plain_recipe(recipe, a, a_arg, w0, "w")
    if out is None and out_dtype is None:
        odt = dtype_name(a.dtype)
    else:
        check_out(out, (m, n if fwd else k), device, "(M, N)" if fwd else "(M, K)", ((a_arg, a), ("w", w)))
        odt = out_dtype_name(out_dtype, out, a.dtype)
    contiguous = a.is_contiguous() and (all_contiguous(w) if is_list else w.is_contiguous())
    problem = intern_problem(
        op, resolved, groups, m, n, k, a.dtype, w0.dtype, odt, device, splits, host, is_list, False, contiguous
    )
    return problem, GroupedInputs(a, w, splits, out, ends_cache(m_splits))


def wgrad(
    dy: Any,
    x: Any,
    m_splits: Any,
    recipe: str | Recipe | None,
    out: Any,
    out_dtype: torch.dtype | None,
    accumulate: bool,
) -> tuple[Problem, GroupedInputs]:
    """Validate ``wgrad`` arguments: dy (M, N), x (M, K), out (G, N, K) or G x (N, K).

    dy and x may be MXTensors blocked along M (each group a whole number of blocks).
    """
    quantized = isinstance(dy, MXTensor) or isinstance(x, MXTensor)
    mx_operand(dy, "dy", "(M, N)")
    mx_operand(x, "x", "(M, K)")
    if not isinstance(accumulate, bool):
        raise InvalidTypeError("accumulate", accumulate, "True or False")
    m, n = dy.shape
    k = x.shape[1]
    if x.shape[0] != m:
        raise ShapeError("x", x, f"(M, K) with M={m} rows like dy")
    device = dy.device
    same_device(device, "x", x)
    check_operand_kind([(name, t) for name, t in (("dy", dy), ("x", x)) if isinstance(t, torch.Tensor)])
    groups = group_count(m_splits)
    splits, host = splits_operand(m_splits, groups, m, "dy", device)
    if quantized:
        resolved = mx_recipe("wgrad", recipe, dy, "dy", x, "x")
        check_row_blocks(splits, host, (("dy", dy), ("x", x)))
    else:
        resolved = plain_recipe(recipe, dy, "dy", x, "x")
    out, is_list = wgrad_out(out, groups, n, k, device, accumulate, (("dy", dy), ("x", x)))
    odt = out_dtype_name(out_dtype, out, default_out_dtype(dy))
    contiguous = mx_contiguous(dy, x) if quantized else all_contiguous(dy, x)
    problem = intern_problem(
        "wgrad",
        resolved,
        groups,
        m,
        n,
        k,
        operand_format(dy),
        operand_format(x),
        odt,
        device,
        splits,
        host,
        is_list,
        accumulate,
        contiguous,
    )
    return problem, GroupedInputs(dy, x, splits, list(out) if is_list else out, ends_cache(m_splits))
