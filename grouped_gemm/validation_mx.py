"""Validation when an operand is a pre-quantized MXTensor.

Reached only when an operand is an MXTensor, so the plain-tensor path pays nothing.
Each op needs its operands blocked along its contraction dimension:

- fwd:   x (M, K) along K (axis 1),  w (G, N, K) along K (axis 2)
- dgrad: dy (M, N) along N (axis 1), w (G, N, K) along N (axis 1)
- wgrad: dy (M, N) and x (M, K) along M (axis 0), every group a whole number of blocks
"""

from __future__ import annotations

from typing import Any

import torch

from grouped_gemm import config
from grouped_gemm.arguments import (
    check_operand_kind,
    check_out,
    check_tensor,
    dtype_name,
    first,
    intern_problem,
    out_dtype_name,
    splits_operand,
    weight_operand,
)
from grouped_gemm.errors import DeviceMismatchError, DTypeError, ShapeError, SplitsError
from grouped_gemm.group_offsets import ends_cache
from grouped_gemm.inputs import GroupedInputs
from grouped_gemm.mx import MXTensor
from grouped_gemm.problem import Op, Problem
from grouped_gemm.recipes import PLAIN_DTYPES, Recipe, get_recipe

#: The recipe field each operand's format must match, per op.
_MX_ROLES = {
    "fwd": ("act_format", "weight_format"),
    "dgrad": ("grad_format", "weight_format"),
    "wgrad": ("grad_format", "act_format"),
}
_MX_AXIS = {"fwd": (1, 2), "dgrad": (1, 1), "wgrad": (0, 0)}
_AXIS_NAMES = {"fwd": ("K", "K"), "dgrad": ("N", "N"), "wgrad": ("M", "M")}
#: Recipes inferred from the operands' formats (None: a plain tensor) when recipe=None.
_MX_INFER = {
    "fwd": {("e4m3", "e4m3"): "mxfp8", ("e2m1", "e2m1"): "mxfp4", ("e4m3", "e2m1"): "a8w4", (None, "e2m1"): "a16w4"},
    "dgrad": {
        ("e4m3", "e4m3"): "mxfp8",
        ("e5m2", "e4m3"): "mxfp8",
        ("e2m1", "e2m1"): "mxfp4",
        ("e4m3", "e2m1"): "a8w4",
        ("e5m2", "e2m1"): "a8w4",
        (None, "e2m1"): "a16w4",
    },
    "wgrad": {("e4m3", "e4m3"): "mxfp8", ("e5m2", "e4m3"): "mxfp8", ("e2m1", "e2m1"): "mxfp4"},
}
_mx_recipes: dict[tuple, Recipe] = {}


def _mx_key(t: Any) -> Any:
    """What recipe resolution depends on: an MXTensor's (fmt, axis, block), else the dtype."""
    return (t.fmt, t.axis, t.block_size) if isinstance(t, MXTensor) else t.dtype


def mx_operand(t: Any, argument: str, dims: str) -> None:
    """Type and rank of one operand that may be an MXTensor."""
    if isinstance(t, MXTensor):
        if t.ndim != len(dims.split(",")):
            raise ShapeError(argument, t, f"an MXTensor of logical shape {dims}, got shape {t.shape}")
    else:
        check_tensor(t, argument, len(dims.split(",")), dims)


def mx_recipe(op: Op, recipe: str | Recipe | None, a: Any, a_arg: str, b: Any, b_arg: str) -> Recipe:
    """Resolve the recipe against MXTensor operands (memoized when valid)."""
    key = (op, recipe, _mx_key(a), _mx_key(b))
    try:
        return _mx_recipes[key]
    except (KeyError, TypeError):
        pass
    resolved = _resolve_mx_recipe(op, recipe, a, a_arg, b, b_arg)  # raises for an unhashable recipe
    _mx_recipes[key] = resolved
    return resolved


def _resolve_mx_recipe(op: Op, recipe: str | Recipe | None, a: Any, a_arg: str, b: Any, b_arg: str) -> Recipe:
    fmts = tuple(t.fmt if isinstance(t, MXTensor) else None for t in (a, b))
    if recipe is None:
        name = _MX_INFER[op].get(fmts)
        if name is None:
            found = " and ".join(f"{arg}: {f or 'plain'}" for arg, f in zip((a_arg, b_arg), fmts, strict=True))
            known = "; ".join(f"{x or 'plain'}/{y} -> {r}" for (x, y), r in _MX_INFER[op].items())
            raise DTypeError(a_arg, a, f"formats a recipe can be inferred from ({known}); got {found}: pass recipe=")
        resolved = get_recipe(name)
        if op != "fwd" and fmts[0] is not None and fmts[0] != resolved.grad_format:
            resolved = resolved.model_copy(update={"grad_format": fmts[0]})
    else:
        resolved = get_recipe(recipe)
    for (arg, t), field, axis, axis_name in zip(
        ((a_arg, a), (b_arg, b)), _MX_ROLES[op], _MX_AXIS[op], _AXIS_NAMES[op], strict=True
    ):
        want = getattr(resolved, field)
        if not isinstance(t, MXTensor):
            allowed = PLAIN_DTYPES if resolved.plain_dtype is None else (resolved.plain_dtype,)
            if dtype_name(t.dtype) not in allowed:
                raise DTypeError(arg, t, f"recipe {resolved.name} takes {' / '.join(allowed)} or MX {arg}")
            continue
        if want is None:
            keeps = "takes plain tensors" if resolved.plain_dtype else f"keeps {arg} in high precision"
            raise DTypeError(arg, t, f"recipe {resolved.name} {keeps}; pass {arg} unquantized, not an MX {t.fmt}")
        if t.fmt != want:
            raise DTypeError(arg, t, f"recipe {resolved.name} quantizes {arg} ({field}) to {want}, not {t.fmt}")
        if t.axis != axis:
            raise ShapeError(
                arg,
                t,
                f"{op} needs {arg} blocked along {axis_name} (axis {axis}); this MXTensor is blocked along axis "
                f"{t.axis} (a quantized tensor and its transpose are not interchangeable: quantize again along "
                f"axis {axis}{', e.g. gg.quantize_mx_weight(w, fmt, op=' + repr(op) + ')' if arg == 'w' else ''})",
            )
        if t.block_size != resolved.block_size:
            raise ShapeError(arg, t, f"blocks of {resolved.block_size} (recipe {resolved.name}), got {t.block_size}")
    return resolved


def mx_contiguous(*operands: Any) -> bool:
    return all(t.is_contiguous() for t in operands)


def mx_fwd_or_dgrad(
    op: Op,
    a: Any,
    w: Any,
    m_splits: Any,
    recipe: str | Recipe | None,
    out: Any,
    out_dtype: torch.dtype | None,
) -> tuple[Problem, GroupedInputs]:
    """``fwd_or_dgrad`` when x / dy or w is an MXTensor (lists of weights stay plain)."""
    fwd = op == "fwd"
    a_arg = "x" if fwd else "dy"
    mx_operand(a, a_arg, "(M, K)" if fwd else "(M, N)")
    if isinstance(w, MXTensor):
        mx_operand(w, "w", "(G, N, K)")
        groups, n, k = w.shape
        if groups < 1:
            raise ShapeError("w", w, "at least one group (G >= 1)")
        is_list = False
        w0 = w
    else:
        w, groups, n, k, is_list = weight_operand(w, "w")
        w0 = first(w)
    m, inner = a.shape
    if inner != (k if fwd else n):
        dims = "(M, K) with K" if fwd else "(M, N) with N"
        raise ShapeError(a_arg, a, f"{dims}={k if fwd else n} to match w {(groups, n, k)}")
    device = a.device
    if w0.device != device:
        raise DeviceMismatchError("w", w0, f"a tensor on {device}, like the other operands")
    check_operand_kind([(name, t) for name, t in ((a_arg, a), ("w", w0)) if isinstance(t, torch.Tensor)])
    splits, host = splits_operand(m_splits, groups, m, a_arg, device)
    resolved = mx_recipe(op, recipe, a, a_arg, w0, "w")
    check_out(out, (m, n if fwd else k), device, "(M, N)" if fwd else "(M, K)", ((a_arg, a), ("w", w)))
    odt = out_dtype_name(out_dtype, out, default_out_dtype(a))
    contiguous = mx_contiguous(a, *(w if is_list else (w,)))
    problem = intern_problem(
        op,
        resolved,
        groups,
        m,
        n,
        k,
        operand_format(a),
        operand_format(w0),
        odt,
        device,
        splits,
        host,
        is_list,
        False,
        contiguous,
    )
    return problem, GroupedInputs(a, w, splits, out, ends_cache(m_splits))


def check_row_blocks(splits: list[int] | torch.Tensor, host: bool, operands: tuple[tuple[str, Any], ...]) -> None:
    """wgrad MXTensor operands are blocked along M: no block may straddle two groups."""
    for name, t in operands:
        if not isinstance(t, MXTensor):
            continue
        if t.pad:
            raise ShapeError(name, t, "an MXTensor without padding along M (every group a whole number of blocks)")
        if host:
            bad = next(((g, s) for g, s in enumerate(splits) if s % t.block_size), None)
            if bad is not None:
                raise SplitsError(
                    "m_splits",
                    splits,
                    f"multiples of {t.block_size} when {name} is an MXTensor blocked along M (a block may not "
                    f"straddle two groups): m_splits[{bad[0]}]={bad[1]}; pass {name} unquantized instead",
                )
        elif config.settings().check_device_splits:
            torch._assert_async(
                (splits % t.block_size == 0).all(),
                f"grouped_gemm: m_splits must be multiples of {t.block_size} when {name} is an MXTensor",
            )


def operand_format(t: Any) -> torch.dtype | str:
    """What ``Problem`` records for an operand: its dtype, or ``"mx_<fmt>"``."""
    return t.problem_format if isinstance(t, MXTensor) else t.dtype


def default_out_dtype(a: Any) -> torch.dtype:
    """The result dtype when none is asked for: ``a``'s dtype, bf16 for an MXTensor ``a``."""
    return torch.bfloat16 if isinstance(a, MXTensor) else a.dtype
