"""Argument checks shared by plain and MX validation, and Problem interning.

Each helper raises the library's errors naming the argument, the value and what is
allowed; ``validation`` and ``validation_mx`` compose them per op.
"""

from __future__ import annotations

import itertools
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
from grouped_gemm.group_offsets import GroupOffsets
from grouped_gemm.problem import Op, Problem, m_alignment, max_rows_bucket
from grouped_gemm.recipes import PLAIN_DTYPES, Recipe, get_recipe, plain_recipe_for
from grouped_gemm.registry import _registry, registry
from grouped_gemm.results import operand_tensors

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return _DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def check_tensor(value: Any, argument: str, ndim: int, dims: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidTypeError(argument, value, f"a torch.Tensor of shape {dims}")
    if value.dim() != ndim:
        raise ShapeError(argument, value, f"a {ndim}-D tensor of shape {dims}, got {value.dim()}-D")
    return value


def check_operand_kind(pairs: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Dense, data-bearing operands that do not require grad (with grad mode on).

    The functional ops are not differentiable: a graph through them would be partial
    on some backends and crash on others, so they refuse tensors that require grad and
    point to the differentiable layer instead.
    """
    for name, t in pairs:
        if t.layout is not torch.strided:
            raise InvalidArgumentError(name, t, f"a dense (strided) tensor, got layout {t.layout}; call .to_dense()")
        if t.device.type == "meta":
            raise DeviceMismatchError(name, t, "a tensor with data (CPU or GPU); meta tensors have none")
        if t.requires_grad and torch.is_grad_enabled():
            raise InvalidArgumentError(
                name,
                t,
                "a tensor that does not require grad: the functional grouped GEMMs are not differentiable; "
                "use gg.grouped_linear / gg.GroupedLinear for autograd, or call under torch.no_grad()",
            )


def weight_operand(w: Any, argument: str) -> tuple[Any, int, int, int, bool]:
    """(w, G, N, K, is_list) for a (G, N, K) tensor or a list of G (N, K) tensors."""
    if isinstance(w, torch.Tensor):
        check_tensor(w, argument, 3, "(G, N, K)")
        g, n, k = w.shape
        if g < 1:
            raise ShapeError(argument, w, "at least one group (G >= 1)")
        return w, g, n, k, False
    if isinstance(w, (list, tuple)) and w:
        first = check_tensor(w[0], f"{argument}[0]", 2, "(N, K)")
        for i, item in enumerate(w[1:], 1):
            t = check_tensor(item, f"{argument}[{i}]", 2, "(N, K)")
            if t.shape != first.shape:
                raise ShapeError(f"{argument}[{i}]", t, f"every group's weight has shape {tuple(first.shape)}")
            if t.dtype != first.dtype:
                raise DTypeError(f"{argument}[{i}]", t, f"every group's weight has dtype {first.dtype}")
            if t.device != first.device:
                raise DeviceMismatchError(f"{argument}[{i}]", t, f"every group's weight is on {first.device}")
        n, k = first.shape
        return list(w), len(w), n, k, True
    raise InvalidTypeError(argument, w, "a (G, N, K) tensor or a non-empty list of G (N, K) tensors")


def first(t: Any) -> torch.Tensor:
    return t[0] if isinstance(t, list) else t


def all_contiguous(*operands: Any) -> bool:
    for t in operands:
        if isinstance(t, list):
            if not all(i.is_contiguous() for i in t):
                return False
        elif not t.is_contiguous():
            return False
    return True


def _host_splits(values: Sequence[Any], groups: int, rows: int, rows_arg: str) -> tuple[int, ...]:
    """Validated host splits; the fast path is one ``sum`` and one ``min``."""
    if len(values) != groups:
        raise SplitsError("m_splits", values, f"one entry per group: expected {groups}, got {len(values)}")
    try:
        total = sum(values)
        lowest = min(values)
    except (TypeError, ValueError, RuntimeError):  # e.g. a multi-element tensor among them
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
    return tuple(values)


def _as_ints(values: Sequence[Any]) -> list[int]:
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or type(v).__name__ == "bool_":
            raise SplitsError("m_splits", values, f"integers; m_splits[{i}]={v!r} is a bool")
        if isinstance(v, torch.Tensor) and (v.dtype not in _INT_DTYPES or v.numel() != 1):
            raise SplitsError(
                "m_splits", values, f"integers; m_splits[{i}] is a tensor of dtype {v.dtype} with {v.numel()} elements"
            )
        try:
            out.append(operator.index(v))
        except TypeError:
            raise SplitsError("m_splits", values, f"integers; m_splits[{i}]={v!r} is a {type(v).__name__}") from None
    return out


def splits_type_error(m_splits: Any) -> InvalidTypeError:
    return InvalidTypeError(
        "m_splits",
        m_splits,
        "a list/tuple of ints, a 1-D integer tensor (on the host or on the device) or gg.offsets(m_splits)",
    )


def host_split_ints(values: Any, argument: str = "m_splits") -> list[int]:
    """Group sizes given as a list/tuple of ints (Python, numpy or 1-element integer
    tensors) or a 1-D integer tensor on the CPU, as Python ints; bools and floats are
    rejected. The one parser of host splits (``quantize_mx_rows`` uses it too)."""
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype not in _INT_DTYPES:
            raise SplitsError(argument, values, "a 1-D integer tensor (int32 or int64)")
        return values.tolist()
    if not isinstance(values, (list, tuple)):
        raise splits_type_error(values)
    try:
        return _as_ints(values)
    except SplitsError as exc:
        raise SplitsError(argument, values, exc.allowed) from None


def snapshot_splits(m_splits: Any) -> Any:
    """A copy of ``m_splits`` taken at forward time: backward must use the splits the
    forward used, even if the caller edits their list or tensor in place meanwhile (a
    device tensor is copied asynchronously, without a sync). A ``gg.offsets`` result is
    already a private copy and passes through, as do other values (validation names them)."""
    if isinstance(m_splits, torch.Tensor):
        return m_splits.clone()
    if isinstance(m_splits, (list, tuple)):
        return [v.clone() if isinstance(v, torch.Tensor) else v for v in m_splits]
    return m_splits


def check_bias(bias: Any, groups: int, n: int, like: torch.Tensor) -> None:
    """A ``(G, N)`` bias on ``like``'s device, checked before any GEMM runs."""
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor):
        raise InvalidTypeError("bias", bias, f"a torch.Tensor of shape (G, N)={(groups, n)} or None")
    if tuple(bias.shape) != (groups, n):
        raise ShapeError("bias", bias, f"shape (G, N)={(groups, n)}")
    if bias.device != like.device:
        raise DeviceMismatchError("bias", bias, f"a tensor on {like.device}, like the operands")
    if not bias.dtype.is_floating_point:
        raise DTypeError("bias", bias, "a floating-point tensor")


def splits_operand(
    m_splits: Any, groups: int, rows: int, rows_arg: str, device: torch.device
) -> tuple[tuple[int, ...] | torch.Tensor, bool]:
    """(splits, on_host): a tuple of ints, or a device tensor.

    A ``GroupOffsets`` is taken as its ``splits`` tensor (whose total, when known on the
    host, is checked against ``rows`` here at no cost)."""
    if isinstance(m_splits, (list, tuple)):
        return _host_splits(m_splits, groups, rows, rows_arg), True
    if type(m_splits) is GroupOffsets:
        if m_splits.total is not None and m_splits.total != rows:
            raise SplitsError(
                "m_splits",
                m_splits,
                f"group sizes summing to {rows_arg}.shape[0]={rows}, but they sum to {m_splits.total}",
            )
        m_splits = m_splits.splits
    if not isinstance(m_splits, torch.Tensor):
        raise splits_type_error(m_splits)
    if m_splits.dim() != 1 or m_splits.dtype not in _INT_DTYPES:
        raise SplitsError("m_splits", m_splits, "a 1-D integer tensor (int32 or int64)")
    if m_splits.numel() != groups:
        raise SplitsError("m_splits", m_splits, f"one entry per group: expected {groups}, got {m_splits.numel()}")
    if m_splits.device.type == "cpu":
        return _host_splits(m_splits.tolist(), groups, rows, rows_arg), True
    if m_splits.device.type == "meta":
        raise SplitsError("m_splits", m_splits, "a tensor with data (on the CPU or the operands' device), not meta")
    if m_splits.device != device:
        raise DeviceMismatchError("m_splits", m_splits, f"on the operands' device {device} or on the CPU")
    if config.settings().check_device_splits:
        assert_device_splits(m_splits, rows, rows_arg)
    return m_splits, False


def assert_device_splits(m_splits: torch.Tensor, rows: int, rows_arg: str) -> None:
    """Asynchronous device asserts that the splits are group sizes summing to ``rows``.

    Every entry is checked to lie in ``[0, rows]`` before the sum is trusted: with that
    bound the int64 sum of G entries cannot wrap (it would need G * rows >= 2**63), so
    entries like ``[2**63 - 1, 2**63 - 1, 12]`` cannot fake a matching sum."""
    in_range = ((m_splits >= 0) & (m_splits <= rows)).all()
    torch._assert_async(in_range, f"grouped_gemm: an m_splits entry is outside [0, {rows_arg}.shape[0]={rows}]")
    total = m_splits.sum(dtype=torch.int64)
    torch._assert_async(total == rows, f"grouped_gemm: m_splits does not sum to {rows_arg}.shape[0]={rows}")


def same_device(device: torch.device, name: str, t: Any) -> None:
    t0 = first(t)
    if t0.device != device:
        raise DeviceMismatchError(name, t0, f"a tensor on {device}, like the other operands")


_recipes: dict[tuple, Recipe] = {}


def plain_recipe(recipe: str | Recipe | None, a: torch.Tensor, a_arg: str, b: torch.Tensor, b_arg: str) -> Recipe:
    """Resolve the recipe and check the operand dtypes against it (memoized when valid)."""
    try:
        key = (recipe, a.dtype, b.dtype, a_arg)
        return _recipes[key]
    except (KeyError, TypeError):
        pass
    resolved = _resolve_plain_recipe(recipe, a, a_arg, b, b_arg)
    if len(_recipes) >= 256:  # distinct Recipe objects could otherwise pile up
        _recipes.clear()
    _recipes[key] = resolved
    return resolved


def _resolve_plain_recipe(
    recipe: str | Recipe | None, a: torch.Tensor, a_arg: str, b: torch.Tensor, b_arg: str
) -> Recipe:
    if recipe is None:
        if b.dtype != a.dtype:
            raise DTypeError(
                b_arg,
                b,
                f"{a_arg} and {b_arg} must have one dtype, but {a_arg} is {a.dtype} and {b_arg} is {b.dtype}: "
                "cast one of them (or pass an MX recipe=)",
            )
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
                    f"recipe {resolved.name} takes {resolved.plain_dtype} operands, but {a_arg} is {a.dtype} "
                    f"and {b_arg} is {b.dtype}",
                )
    else:
        for name, t in ((a_arg, a), (b_arg, b)):
            if dtype_name(t.dtype) not in PLAIN_DTYPES:
                raise DTypeError(name, t, f"recipe {resolved.name} quantizes bfloat16, float16 or float32 tensors")
    return resolved


def out_dtype_name(out_dtype: torch.dtype | None, out: Any, default: torch.dtype) -> str:
    if out_dtype is not None and dtype_name(out_dtype) not in PLAIN_DTYPES:
        raise DTypeError("out_dtype", out_dtype, "torch.bfloat16, torch.float16 or torch.float32")
    if out is not None:
        dt = first(out).dtype
        if out_dtype is not None and dt != out_dtype:
            raise DTypeError("out", first(out), f"dtype out_dtype={out_dtype}")
        if dtype_name(dt) not in PLAIN_DTYPES:
            raise DTypeError("out", first(out), "dtype bfloat16, float16 or float32")
        return dtype_name(dt)
    return dtype_name(out_dtype or default)


def check_out(out: Any, shape: tuple[int, ...], device: torch.device, dims: str, operands: tuple = ()) -> None:
    """``out`` has the result's shape, the operands' device, and none of their memory."""
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
    check_no_overlap([out], operands)


def _span(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(storage, first byte, end byte) a tensor can touch; None when it has no elements."""
    if t.numel() == 0:
        return None
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    start = t.data_ptr()
    return t.untyped_storage().data_ptr(), start, start + (extent + 1) * t.element_size()


def check_no_overlap(outs: Sequence[torch.Tensor], operands: tuple) -> None:
    """InvalidArgumentError naming ``out`` when an output buffer shares memory with an
    input (the kernel would read what it already overwrote) or with another output
    buffer (``out=[buf] * G``: the groups would overwrite each other)."""
    out_spans = [(i, _span(o)) for i, o in enumerate(outs)]
    out_spans = sorted(((sp, i) for i, sp in out_spans if sp is not None), key=lambda item: item[0])
    for (a, i), (b, j) in itertools.pairwise(out_spans):
        if a[0] == b[0] and b[1] < a[2]:
            raise InvalidArgumentError(
                "out", outs[j], f"G distinct buffers; out[{i}] and out[{j}] share memory (e.g. out=[buf] * G)"
            )
    if not operands:
        return
    inputs = [(name, sp) for name, t in operands for sp in map(_span, operand_tensors(t)) if sp is not None]
    for span, i in out_spans:
        for name, other in inputs:
            if span[0] == other[0] and span[1] < other[2] and other[1] < span[2]:
                where = f"out[{i}]" if len(outs) > 1 else "out"
                raise InvalidArgumentError(
                    "out", outs[i], f"a buffer that shares no memory with the input {name}; {where} overlaps it"
                )


_problems: dict[tuple, Problem] = {}
_PROBLEM_CACHE_LIMIT = 4096


def intern_problem(
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
    reg = _registry if _registry._loaded else registry()
    m_align = m_alignment(splits if host else None, reg.max_m_multiple)
    max_rows = max_rows_bucket(splits) if host and groups <= reg.max_rows_groups else None
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
        max_rows,
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
            max_rows=max_rows,
        )
        _problems[key] = problem
    return problem


def group_count(m_splits: Any) -> int:
    """G for wgrad, where only ``m_splits`` says how many groups there are."""
    if isinstance(m_splits, torch.Tensor):
        groups = m_splits.numel()
    elif type(m_splits) is GroupOffsets or isinstance(m_splits, (list, tuple)):
        groups = len(m_splits)
    else:
        raise splits_type_error(m_splits)
    if groups < 1:
        raise SplitsError("m_splits", m_splits, "at least one group")
    return groups


def wgrad_out(
    out: Any, groups: int, n: int, k: int, device: torch.device, accumulate: bool, operands: tuple = ()
) -> tuple[Any, bool]:
    """(out, is_list) for wgrad's ``out``: None, a (G, N, K) tensor, or G (N, K) tensors."""
    is_list = isinstance(out, (list, tuple))
    if is_list:
        out, g_out, n_out, k_out, _ = weight_operand(out, "out")
        if (g_out, n_out, k_out) != (groups, n, k):
            raise ShapeError("out", out[0], f"G={groups} tensors of shape (N, K)={(n, k)}")
        same_device(device, "out", out)
        if not all_contiguous(out):
            raise InvalidArgumentError("out", out[0], "contiguous tensors")
        check_no_overlap(out, operands)
    else:
        check_out(out, (groups, n, k), device, "(G, N, K)", operands)
    if accumulate and out is None:
        raise InvalidArgumentError("accumulate", True, "accumulate=True needs out= (the buffer to add into)")
    return out, is_list
