"""Argument checks shared by plain and MX validation, and Problem interning.

Each helper raises the library's errors naming the argument, the value and what is
allowed; ``validation`` and ``validation_mx`` compose them per op.
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
from grouped_gemm.problem import Op, Problem, m_alignment
from grouped_gemm.recipes import PLAIN_DTYPES, Recipe, get_recipe, plain_recipe_for
from grouped_gemm.registry import _registry, registry

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


def splits_type_error(m_splits: Any) -> InvalidTypeError:
    return InvalidTypeError(
        "m_splits", m_splits, "a list/tuple of ints or a 1-D integer tensor (on the host or on the device)"
    )


def splits_operand(
    m_splits: Any, groups: int, rows: int, rows_arg: str, device: torch.device
) -> tuple[list[int] | torch.Tensor, bool]:
    """(splits, on_host)."""
    if isinstance(m_splits, (list, tuple)):
        return _host_splits(m_splits, groups, rows, rows_arg), True
    if not isinstance(m_splits, torch.Tensor):
        raise splits_type_error(m_splits)
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


def check_out(out: Any, shape: tuple[int, ...], device: torch.device, dims: str) -> None:
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
    cap = _registry.max_m_multiple if _registry._loaded else registry().max_m_multiple
    m_align = m_alignment(splits if host else None, cap)
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


def group_count(m_splits: Any) -> int:
    """G for wgrad, where only ``m_splits`` says how many groups there are."""
    if isinstance(m_splits, torch.Tensor):
        groups = m_splits.numel()
    elif isinstance(m_splits, (list, tuple)):
        groups = len(m_splits)
    else:
        raise splits_type_error(m_splits)
    if groups < 1:
        raise SplitsError("m_splits", m_splits, "at least one group")
    return groups


def wgrad_out(out: Any, groups: int, n: int, k: int, device: torch.device, accumulate: bool) -> tuple[Any, bool]:
    """(out, is_list) for wgrad's ``out``: None, a (G, N, K) tensor, or G (N, K) tensors."""
    is_list = isinstance(out, (list, tuple))
    if is_list:
        out, g_out, n_out, k_out, _ = weight_operand(out, "out")
        if (g_out, n_out, k_out) != (groups, n, k):
            raise ShapeError("out", out[0], f"G={groups} tensors of shape (N, K)={(n, k)}")
        same_device(device, "out", out)
        if not all_contiguous(out):
            raise InvalidArgumentError("out", out[0], "contiguous tensors")
    else:
        check_out(out, (groups, n, k), device, "(G, N, K)")
    if accumulate and out is None:
        raise InvalidArgumentError("accumulate", True, "accumulate=True needs out= (the buffer to add into)")
    return out, is_list
