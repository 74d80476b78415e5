"""Input validation: user arguments -> (Problem, GroupedInputs), or a clear error.

Every check that needs no device-to-host sync is done on every call. Splits that live
on the device are checked for dtype, rank and length only; their sum and signs can be
asserted on the device (``configure(check_device_splits=True)``), asynchronously.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

from grouped_gemm import config
from grouped_gemm.device import device_info
from grouped_gemm.errors import (
    DeviceMismatchError,
    DTypeError,
    InvalidArgumentError,
    InvalidTypeError,
    ShapeError,
    SplitsError,
)
from grouped_gemm.inputs import GroupedInputs
from grouped_gemm.mx import MXTensor
from grouped_gemm.problem import Op, Problem, splits_alignment
from grouped_gemm.recipes import PLAIN_DTYPES, Recipe, get_recipe, plain_recipe_for
from grouped_gemm.registry import _registry, registry

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return _DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def _tensor(value: Any, argument: str, ndim: int, dims: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidTypeError(argument, value, f"a torch.Tensor of shape {dims}")
    if value.dim() != ndim:
        raise ShapeError(argument, value, f"a {ndim}-D tensor of shape {dims}, got {value.dim()}-D")
    return value


def _weight(w: Any, argument: str) -> tuple[Any, int, int, int, bool]:
    """(w, G, N, K, is_list) for a (G, N, K) tensor or a list of G (N, K) tensors."""
    if isinstance(w, torch.Tensor):
        _tensor(w, argument, 3, "(G, N, K)")
        g, n, k = w.shape
        if g < 1:
            raise ShapeError(argument, w, "at least one group (G >= 1)")
        return w, g, n, k, False
    if isinstance(w, (list, tuple)) and w:
        first = _tensor(w[0], f"{argument}[0]", 2, "(N, K)")
        for i, item in enumerate(w[1:], 1):
            t = _tensor(item, f"{argument}[{i}]", 2, "(N, K)")
            if t.shape != first.shape:
                raise ShapeError(f"{argument}[{i}]", t, f"every group's weight has shape {tuple(first.shape)}")
            if t.dtype != first.dtype:
                raise DTypeError(f"{argument}[{i}]", t, f"every group's weight has dtype {first.dtype}")
            if t.device != first.device:
                raise DeviceMismatchError(f"{argument}[{i}]", t, f"every group's weight is on {first.device}")
        n, k = first.shape
        return list(w), len(w), n, k, True
    raise InvalidTypeError(argument, w, "a (G, N, K) tensor or a non-empty list of G (N, K) tensors")


def _first(t: Any) -> torch.Tensor:
    return t[0] if isinstance(t, list) else t


def _contiguous(*operands: Any) -> bool:
    for t in operands:
        if isinstance(t, list):
            if not all(i.is_contiguous() for i in t):
                return False
        elif not t.is_contiguous():
            return False
    return True


def _host_splits(values: Sequence[Any], groups: int, rows: int, rows_arg: str) -> list[int]:
    """Validated host splits; the fast path is one ``sum`` and one ``min``."""
    if len(values) != groups:
        raise SplitsError("m_splits", values, f"one entry per group: expected {groups}, got {len(values)}")
    try:
        total = sum(values)
        lowest = min(values)
    except TypeError:
        total = lowest = None
    if type(total) is not int or type(lowest) is not int:
        values = _as_ints(values)
        total, lowest = sum(values), min(values)
    if lowest < 0:
        index = values.index(lowest)
        raise SplitsError("m_splits", values, f"non-negative group sizes; m_splits[{index}]={lowest}")
    if total != rows:
        raise SplitsError(
            "m_splits", values, f"group sizes summing to {rows_arg}.shape[0]={rows}, but they sum to {total}"
        )
    return values if isinstance(values, list) else list(values)


def _as_ints(values: Sequence[Any]) -> list[int]:
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool):
            raise SplitsError("m_splits", values, f"integers; m_splits[{i}]={v!r} is a bool")
        try:
            out.append(operator.index(v))
        except TypeError:
            raise SplitsError("m_splits", values, f"integers; m_splits[{i}]={v!r} is a {type(v).__name__}") from None
    return out


def _splits_type_error(m_splits: Any) -> InvalidTypeError:
    return InvalidTypeError(
        "m_splits", m_splits, "a list/tuple of ints or a 1-D integer tensor (on the host or on the device)"
    )


def _splits(
    m_splits: Any, groups: int, rows: int, rows_arg: str, device: torch.device
) -> tuple[list[int] | torch.Tensor, bool]:
    """(splits, on_host)."""
    if isinstance(m_splits, (list, tuple)):
        return _host_splits(m_splits, groups, rows, rows_arg), True
    if not isinstance(m_splits, torch.Tensor):
        raise _splits_type_error(m_splits)
    if m_splits.dim() != 1 or m_splits.dtype not in _INT_DTYPES:
        raise SplitsError("m_splits", m_splits, "a 1-D integer tensor (int32 or int64)")
    if m_splits.numel() != groups:
        raise SplitsError("m_splits", m_splits, f"one entry per group: expected {groups}, got {m_splits.numel()}")
    if m_splits.device.type == "cpu":
        return _host_splits(m_splits.tolist(), groups, rows, rows_arg), True
    if m_splits.device != device:
        raise DeviceMismatchError("m_splits", m_splits, f"on the operands' device {device} or on the CPU")
    if config.settings().check_device_splits:
        torch._assert_async((m_splits >= 0).all(), "grouped_gemm: m_splits has a negative entry")
        torch._assert_async(m_splits.sum() == rows, f"grouped_gemm: m_splits does not sum to {rows_arg}.shape[0]")
    return m_splits, False


def _same_device(device: torch.device, name: str, t: Any) -> None:
    t0 = _first(t)
    if t0.device != device:
        raise DeviceMismatchError(name, t0, f"a tensor on {device}, like the other operands")


_recipes: dict[tuple, Recipe] = {}


def _recipe(recipe: str | Recipe | None, a: torch.Tensor, a_arg: str, b: torch.Tensor, b_arg: str) -> Recipe:
    """Resolve the recipe and check the operand dtypes against it (memoized when valid)."""
    try:
        key = (recipe, a.dtype, b.dtype, a_arg)
        return _recipes[key]
    except (KeyError, TypeError):
        pass
    resolved = _resolve_recipe(recipe, a, a_arg, b, b_arg)
    _recipes[key] = resolved
    return resolved


def _resolve_recipe(recipe: str | Recipe | None, a: torch.Tensor, a_arg: str, b: torch.Tensor, b_arg: str) -> Recipe:
    if recipe is None:
        if b.dtype != a.dtype:
            raise DTypeError(b_arg, b, f"dtype {a.dtype}, the dtype of {a_arg} (or pass an MX recipe=)")
        found = plain_recipe_for(dtype_name(a.dtype))
        if found is None:
            raise DTypeError(a_arg, a, f"dtype bfloat16, float16 or float32 (or pass recipe=), got {a.dtype}")
        resolved = found
    else:
        resolved = get_recipe(recipe)
    if resolved.plain_dtype is not None:
        for name, t in ((a_arg, a), (b_arg, b)):
            if dtype_name(t.dtype) != resolved.plain_dtype:
                raise DTypeError(
                    name,
                    t,
                    f"recipe {resolved.name} takes {resolved.plain_dtype} operands, got {t.dtype} "
                    f"(the dtypes of {a_arg} and {b_arg} must match the recipe)",
                )
    else:
        for name, t in ((a_arg, a), (b_arg, b)):
            if dtype_name(t.dtype) not in PLAIN_DTYPES:
                raise DTypeError(name, t, f"recipe {resolved.name} quantizes bfloat16, float16 or float32 tensors")
    return resolved


def _out_dtype(out_dtype: torch.dtype | None, out: Any, default: torch.dtype) -> str:
    if out_dtype is not None and dtype_name(out_dtype) not in PLAIN_DTYPES:
        raise DTypeError("out_dtype", out_dtype, "torch.bfloat16, torch.float16 or torch.float32")
    if out is not None:
        dt = _first(out).dtype
        if out_dtype is not None and dt != out_dtype:
            raise DTypeError("out", _first(out), f"dtype out_dtype={out_dtype}")
        if dtype_name(dt) not in PLAIN_DTYPES:
            raise DTypeError("out", _first(out), "dtype bfloat16, float16 or float32")
        return dtype_name(dt)
    return dtype_name(out_dtype or default)


def _check_out(out: Any, shape: tuple[int, ...], device: torch.device, dims: str) -> None:
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise InvalidTypeError("out", out, f"a torch.Tensor of shape {dims}={shape}")
    if tuple(out.shape) != shape:
        raise ShapeError("out", out, f"shape {dims}={shape}")
    if out.device != device:
        raise DeviceMismatchError("out", out, f"a tensor on {device}, like the operands")
    if not out.is_contiguous():
        raise InvalidArgumentError("out", out, "a contiguous tensor")


_problems: dict[tuple, Problem] = {}
_PROBLEM_CACHE_LIMIT = 4096


def _problem(
    op: Op,
    recipe: Recipe,
    groups: int,
    m: int,
    n: int,
    k: int,
    a_dtype: torch.dtype | str,
    b_dtype: torch.dtype | str,
    out_dtype: str,
    device: torch.device,
    splits: list[int] | torch.Tensor,
    host: bool,
    weight_list: bool,
    accumulate: bool,
    contiguous: bool,
) -> Problem:
    """The Problem for validated arguments, reused across calls with equal fields.

    ``a_dtype`` / ``b_dtype`` are the operands' torch dtypes, or ``"mx_<fmt>"`` for
    pre-quantized MXTensor operands."""
    cap = _registry.max_m_multiple if _registry._loaded else registry().max_m_multiple
    if host:
        m_align = splits_alignment(splits, cap) if cap > 1 else 1
    else:
        m_align = 1 if cap <= 1 else 0
    on_cuda = device.type == "cuda"
    capturing = on_cuda and torch.cuda.is_current_stream_capturing()
    info = device_info(device)
    key = (
        op,
        recipe.name,
        recipe.scale_rule,
        recipe.grad_format,
        groups,
        m,
        n,
        k,
        a_dtype,
        b_dtype,
        out_dtype,
        info,
        host,
        weight_list,
        accumulate,
        contiguous,
        capturing,
        m_align,
    )
    problem = _problems.get(key)
    if problem is None:
        if len(_problems) >= _PROBLEM_CACHE_LIMIT:
            _problems.clear()
        problem = Problem(
            op=op,
            recipe=recipe.name,
            groups=groups,
            m=m,
            n=n,
            k=k,
            a_format=dtype_name(a_dtype),
            b_format=dtype_name(b_dtype),
            out_dtype=out_dtype,
            device=info,
            placement="cuda" if on_cuda else "cpu",
            scale_rule=recipe.scale_rule,
            grad_format=recipe.grad_format,
            host_splits=host,
            weight_list=weight_list,
            accumulate=accumulate,
            contiguous=contiguous,
            capturing=capturing,
            m_align=m_align,
        )
        _problems[key] = problem
    return problem


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
        _tensor(a, a_arg, 2, "(M, K)" if fwd else "(M, N)")
    if isinstance(w, torch.Tensor) and w.dim() == 3:
        groups, n, k = w.shape
        is_list = False
        w0 = w
        if groups < 1:
            _weight(w, "w")
    else:
        if isinstance(w, MXTensor):
            return mx_fwd_or_dgrad(op, a, w, m_splits, recipe, out, out_dtype)
        w, groups, n, k, is_list = _weight(w, "w")
        w0 = w[0]
    m, inner = a.shape
    if inner != (k if fwd else n):
        dims = "(M, K) with K" if fwd else "(M, N) with N"
        raise ShapeError(a_arg, a, f"{dims}={k if fwd else n} to match w {(groups, n, k)}")
    device = a.device
    if w0.device != device:
        _same_device(device, "w", w0)
    if isinstance(m_splits, list) and len(m_splits) == groups:
        try:
            lowest = min(m_splits)
            total = sum(m_splits)
        except (TypeError, ValueError):
            lowest = total = None
        if type(total) is int and type(lowest) is int and lowest >= 0 and total == m:
            splits, host = m_splits, True
        else:
            splits, host = _splits(m_splits, groups, m, a_arg, device)
    else:
        splits, host = _splits(m_splits, groups, m, a_arg, device)
    resolved = _recipe(recipe, a, a_arg, w0, "w")
    if out is None and out_dtype is None:
        odt = dtype_name(a.dtype)
    else:
        _check_out(out, (m, n if fwd else k), device, "(M, N)" if fwd else "(M, K)")
        odt = _out_dtype(out_dtype, out, a.dtype)
    contiguous = a.is_contiguous() and (_contiguous(w) if is_list else w.is_contiguous())
    problem = _problem(
        op, resolved, groups, m, n, k, a.dtype, w0.dtype, odt, device, splits, host, is_list, False, contiguous
    )
    return problem, GroupedInputs(a, w, splits, out)


def wgrad(
    dy: Any,
    x: Any,
    m_splits: Any,
    recipe: str | Recipe | None,
    out: Any,
    out_dtype: torch.dtype | None,
    accumulate: bool,
) -> tuple[Problem, GroupedInputs]:
    """Validate ``wgrad`` arguments: dy (M, N), x (M, K), out (G, N, K) or G x (N, K)."""
    if isinstance(dy, MXTensor) or isinstance(x, MXTensor):
        return mx_wgrad(dy, x, m_splits, recipe, out, out_dtype, accumulate)
    _tensor(dy, "dy", 2, "(M, N)")
    _tensor(x, "x", 2, "(M, K)")
    if not isinstance(accumulate, bool):
        raise InvalidTypeError("accumulate", accumulate, "True or False")
    m, n = dy.shape
    k = x.shape[1]
    if x.shape[0] != m:
        raise ShapeError("x", x, f"(M, K) with M={m} rows like dy")
    device = dy.device
    _same_device(device, "x", x)
    if isinstance(m_splits, torch.Tensor):
        groups = m_splits.numel()
    elif isinstance(m_splits, (list, tuple)):
        groups = len(m_splits)
    else:
        raise _splits_type_error(m_splits)
    if groups < 1:
        raise SplitsError("m_splits", m_splits, "at least one group")
    splits, host = _splits(m_splits, groups, m, "dy", device)
    resolved = _recipe(recipe, dy, "dy", x, "x")
    is_list = isinstance(out, (list, tuple))
    if is_list:
        out, g_out, n_out, k_out, _ = _weight(out, "out")
        if (g_out, n_out, k_out) != (groups, n, k):
            raise ShapeError("out", out[0], f"G={groups} tensors of shape (N, K)={(n, k)}")
        _same_device(device, "out", out)
        if not _contiguous(out):
            raise InvalidArgumentError("out", out[0], "contiguous tensors")
    else:
        _check_out(out, (groups, n, k), device, "(G, N, K)")
    if accumulate and out is None:
        raise InvalidArgumentError("accumulate", True, "accumulate=True needs out= (the buffer to add into)")
    odt = _out_dtype(out_dtype, out, dy.dtype)
    problem = _problem(
        "wgrad",
        resolved,
        groups,
        m,
        n,
        k,
        dy.dtype,
        x.dtype,
        odt,
        device,
        splits,
        host,
        is_list,
        accumulate,
        _contiguous(dy, x),
    )
    return problem, GroupedInputs(a=dy, b=x, m_splits=splits, out=list(out) if is_list else out)


# ---- pre-quantized MXTensor operands ----------------------------------------------------
#
# Reached only when an operand is an MXTensor, so the plain-tensor path above pays nothing.
# Each op needs its operands blocked along its contraction dimension:
#   fwd:   x (M, K) along K (axis 1),  w (G, N, K) along K (axis 2)
#   dgrad: dy (M, N) along N (axis 1), w (G, N, K) along N (axis 1)
#   wgrad: dy (M, N) and x (M, K) along M (axis 0), every group a whole number of blocks

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


def _mx_operand(t: Any, argument: str, dims: str) -> None:
    """Type and rank of one operand that may be an MXTensor."""
    if isinstance(t, MXTensor):
        if t.ndim != len(dims.split(",")):
            raise ShapeError(argument, t, f"an MXTensor of logical shape {dims}, got shape {t.shape}")
    else:
        _tensor(t, argument, len(dims.split(",")), dims)


def _mx_recipe(op: Op, recipe: str | Recipe | None, a: Any, a_arg: str, b: Any, b_arg: str) -> Recipe:
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


def _mx_contiguous(*operands: Any) -> bool:
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
    _mx_operand(a, a_arg, "(M, K)" if fwd else "(M, N)")
    if isinstance(w, MXTensor):
        _mx_operand(w, "w", "(G, N, K)")
        groups, n, k = w.shape
        if groups < 1:
            raise ShapeError("w", w, "at least one group (G >= 1)")
        is_list = False
        w0 = w
    else:
        w, groups, n, k, is_list = _weight(w, "w")
        w0 = _first(w)
    m, inner = a.shape
    if inner != (k if fwd else n):
        dims = "(M, K) with K" if fwd else "(M, N) with N"
        raise ShapeError(a_arg, a, f"{dims}={k if fwd else n} to match w {(groups, n, k)}")
    device = a.device
    if w0.device != device:
        raise DeviceMismatchError("w", w0, f"a tensor on {device}, like the other operands")
    splits, host = _splits(m_splits, groups, m, a_arg, device)
    resolved = _mx_recipe(op, recipe, a, a_arg, w0, "w")
    _check_out(out, (m, n if fwd else k), device, "(M, N)" if fwd else "(M, K)")
    odt = _out_dtype(out_dtype, out, torch.bfloat16 if isinstance(a, MXTensor) else a.dtype)
    contiguous = _mx_contiguous(a, *(w if is_list else (w,)))
    a_fmt = a.problem_format if isinstance(a, MXTensor) else a.dtype
    b_fmt = w0.problem_format if isinstance(w0, MXTensor) else w0.dtype
    problem = _problem(
        op, resolved, groups, m, n, k, a_fmt, b_fmt, odt, device, splits, host, is_list, False, contiguous
    )
    return problem, GroupedInputs(a, w, splits, out)


def _check_row_blocks(splits: list[int] | torch.Tensor, host: bool, operands: tuple[tuple[str, Any], ...]) -> None:
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


def mx_wgrad(
    dy: Any,
    x: Any,
    m_splits: Any,
    recipe: str | Recipe | None,
    out: Any,
    out_dtype: torch.dtype | None,
    accumulate: bool,
) -> tuple[Problem, GroupedInputs]:
    """``wgrad`` when dy or x is an MXTensor blocked along M (axis 0)."""
    _mx_operand(dy, "dy", "(M, N)")
    _mx_operand(x, "x", "(M, K)")
    if not isinstance(accumulate, bool):
        raise InvalidTypeError("accumulate", accumulate, "True or False")
    m, n = dy.shape
    k = x.shape[1]
    if x.shape[0] != m:
        raise ShapeError("x", x, f"(M, K) with M={m} rows like dy")
    device = dy.device
    if x.device != device:
        raise DeviceMismatchError("x", x, f"a tensor on {device}, like the other operands")
    if isinstance(m_splits, torch.Tensor):
        groups = m_splits.numel()
    elif isinstance(m_splits, (list, tuple)):
        groups = len(m_splits)
    else:
        raise _splits_type_error(m_splits)
    if groups < 1:
        raise SplitsError("m_splits", m_splits, "at least one group")
    splits, host = _splits(m_splits, groups, m, "dy", device)
    resolved = _mx_recipe("wgrad", recipe, dy, "dy", x, "x")
    _check_row_blocks(splits, host, (("dy", dy), ("x", x)))
    is_list = isinstance(out, (list, tuple))
    if is_list:
        out, g_out, n_out, k_out, _ = _weight(out, "out")
        if (g_out, n_out, k_out) != (groups, n, k):
            raise ShapeError("out", out[0], f"G={groups} tensors of shape (N, K)={(n, k)}")
        _same_device(device, "out", out)
        if not _contiguous(out):
            raise InvalidArgumentError("out", out[0], "contiguous tensors")
    else:
        _check_out(out, (groups, n, k), device, "(G, N, K)")
    if accumulate and out is None:
        raise InvalidArgumentError("accumulate", True, "accumulate=True needs out= (the buffer to add into)")
    odt = _out_dtype(out_dtype, out, torch.bfloat16 if isinstance(dy, MXTensor) else dy.dtype)
    a_fmt = dy.problem_format if isinstance(dy, MXTensor) else dy.dtype
    b_fmt = x.problem_format if isinstance(x, MXTensor) else x.dtype
    problem = _problem(
        "wgrad",
        resolved,
        groups,
        m,
        n,
        k,
        a_fmt,
        b_fmt,
        odt,
        device,
        splits,
        host,
        is_list,
        accumulate,
        _mx_contiguous(dy, x),
    )
    return problem, GroupedInputs(a=dy, b=x, m_splits=splits, out=list(out) if is_list else out)
