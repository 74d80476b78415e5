"""Input validation: user arguments -> a validated ``Call``, or an error naming the
argument, the value and what is allowed.

Every check that needs no device-to-host sync runs on every call. Splits that live on
the device are checked for dtype, rank and length only; their sum and signs can be
asserted on the device (``configure(check_device_splits=True)``), asynchronously.

What depends only on the call's signature (the recipe against the operands' dtypes or MX
formats, the output dtype, the chip) is checked when the call's Problem is built
(``Call.problem``): on a dispatch-cache miss and by ``explain``; a cached signature was
valid when it was cached. Pre-quantized ``MXTensor`` operands go through the same checks;
the MX rules (blocking axis per op, recipe inference, whole blocks per group) are their
own section below. Each op needs MX operands blocked along its contraction dimension:

- fwd:   x (M, K) along K (axis 1),  w (G, N, K) along K (axis 2)
- dgrad: dy (M, N) along N (axis 1), w (G, N, K) along N (axis 1)
- wgrad: dy (M, N) and x (M, K) along M (axis 0), every group a whole number of blocks
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

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
from grouped_gemm.group_offsets import GroupOffsets, as_ints, ends_cache, split_tensor_refusal, splits_type_error
from grouped_gemm.inputs import GroupedInputs
from grouped_gemm.mx import MXTensor
from grouped_gemm.problem import Op, Problem, build_problem, m_bucket, split_facts
from grouped_gemm.recipes import Recipe, get_recipe, plain_recipe_for
from grouped_gemm.registry import registry
from grouped_gemm.results import operand_tensors
from grouped_gemm.torch_device import device_kind, stream_capturing
from grouped_gemm.vocabulary import FLOAT_DTYPE_NAMES, SPLIT_DTYPES, dtype_name

_STRIDED = torch.strided
#: The argument names of each op's two operands.
OPERAND_NAMES: dict[Op, tuple[str, str]] = {"fwd": ("x", "w"), "dgrad": ("dy", "w"), "wgrad": ("dy", "x")}


# ---- the validated call -------------------------------------------------------------------


#: Builds a CallKey from a tuple in C, without the NamedTuple's Python-level ``__new__``
#: (half the cost, on every call).
_new_key = tuple.__new__


class CallKey(NamedTuple):
    """What a call's Problem depends on, as the caller passed it: the dispatch cache's key.

    Problem's fields, with the recipe, the operand formats and the output dtype as given
    (they are resolved, and checked, when the Problem is built), the torch device in place
    of the chip, and M bucketed as in ``Problem.signature``.
    """

    op: Op
    recipe: Any
    a_format: Any  # a's torch dtype, or an MXTensor's (fmt, axis, block_size)
    b_format: Any
    out_dtype: Any  # out_dtype as passed
    out_given: torch.dtype | None  # the dtype of out (of its first tensor), None without out
    groups: int
    m_bucket: int
    n: int
    k: int
    device: torch.device
    host_splits: bool
    m_align: int
    max_rows: int | None
    weight_list: bool
    accumulate: bool
    contiguous: bool
    capturing: bool


@dataclasses.dataclass(slots=True)
class Call:
    """One validated call: its cache key, its exact M, and the operands a backend gets."""

    key: CallKey
    m: int
    inputs: GroupedInputs

    def problem(self) -> Problem:
        """Resolve the recipe and the output dtype against the operands (the checks that
        depend only on ``key``) and build the call's Problem."""
        key, inputs = self.key, self.inputs
        a, b = inputs.a, first(inputs.b)
        a_arg, b_arg = OPERAND_NAMES[key.op]
        recipe = resolve_recipe(key.op, key.recipe, a, a_arg, b, b_arg)
        out_dtype = out_dtype_name(key.out_dtype, inputs.out, default_out_dtype(a))
        reg = registry()
        return build_problem(
            op=key.op,
            recipe=recipe,
            groups=key.groups,
            m=self.m,
            n=key.n,
            k=key.k,
            a_format=operand_format(a),
            b_format=operand_format(b),
            out_dtype=out_dtype,
            device=device_info(key.device),
            placement="cuda" if key.device.type == "cuda" else "cpu",
            splits=inputs.m_splits if key.host_splits else None,
            m_align_cap=reg.max_m_multiple,
            weight_list=key.weight_list,
            accumulate=key.accumulate,
            contiguous=key.contiguous,
            capturing=key.capturing,
        )


def fwd_or_dgrad(
    op: Op,
    a: Any,
    w: Any,
    m_splits: Any,
    recipe: str | Recipe | None,
    out: Any,
    out_dtype: torch.dtype | None,
) -> Call:
    """Validate ``fwd`` (a = x, (M, K)) or ``dgrad`` (a = dy, (M, N)) arguments; w is a
    (G, N, K) tensor or MXTensor, or a list of G (N, K) tensors."""
    fwd = op == "fwd"
    a_arg = "x" if fwd else "dy"
    if isinstance(a, torch.Tensor) and a.dim() == 2 and not a.is_nested:  # (1-D parts: dim() 2)
        a_format = a.dtype
    else:
        check_operand(a, a_arg, "(M, K)" if fwd else "(M, N)")
        a_format = mx_format(a)
    if isinstance(w, torch.Tensor) and w.dim() == 3 and not w.is_nested:
        groups, n, k = w.shape  # (one read of the shape: ~0.1 us each)
        if groups < 1:
            raise ShapeError("w", w, "at least one group (G >= 1)")
        is_list = False
        w0 = w
        b_format = w.dtype
    elif isinstance(w, MXTensor):
        if len(w.shape) != 3:
            check_operand(w, "w", "(G, N, K)")  # raises, naming the rank
        groups, n, k = w.shape
        if groups < 1:
            raise ShapeError("w", w, "at least one group (G >= 1)")
        is_list = False
        w0 = w
        b_format = mx_format(w)
    else:
        w, groups, n, k, is_list = check_grouped_matrices(w, "w")
        w0 = w[0] if is_list else w
        b_format = w0.dtype
    # A list: every group's weight (a later one may require grad or be sparse). Otherwise one
    # plain test of each operand on the hot path (an MXTensor passes it).
    if is_list or _unusual(a, w0):
        check_operand_kind(_tensor_operands(a_arg, a, w))
    m, inner = a.shape
    if inner != (k if fwd else n):
        dims = "(M, K) with K" if fwd else "(M, N) with N"
        raise ShapeError(a_arg, a, f"{dims}={k if fwd else n} to match w {(groups, n, k)}")
    device = a.device
    if w0.device != device:
        if device_kind(device) == "meta":  # the operand without data is at fault, not w
            raise DeviceMismatchError(a_arg, a, META_REFUSAL)
        raise DeviceMismatchError("w", w0, f"a tensor on {device}, like the other operands")
    kind = device_kind(device)
    if kind == "meta":  # whichever operand is a plain tensor (MXTensor operands skip the test above)
        check_operand_kind(_tensor_operands(a_arg, a, w))
        raise DeviceMismatchError(a_arg, a, META_REFUSAL)  # both MXTensors: no plain tensor to name
    splits, host = splits_operand(m_splits, groups, m, a_arg, device)
    if out is not None:
        check_out(out, (m, n if fwd else k), device, "(M, N)" if fwd else "(M, K)", ((a_arg, a), ("w", w)))
    m_align, max_rows = split_facts(splits if host else None, m_align_cap=registry().max_m_multiple)
    capturing = kind == "cuda" and stream_capturing()
    key = _new_key(
        CallKey,
        (
            op,
            recipe,
            a_format,
            b_format,
            out_dtype,
            None if out is None else out.dtype,
            groups,
            m_bucket(m),
            n,
            k,
            device,
            host,
            m_align,
            max_rows,
            is_list,
            False,
            a.is_contiguous() and (all_contiguous(w) if is_list else w.is_contiguous()),
            capturing,
        ),
    )
    return Call(key, m, GroupedInputs(a, w, splits, out, ends_cache(m_splits), capturing))


def wgrad(
    dy: Any,
    x: Any,
    m_splits: Any,
    recipe: str | Recipe | None,
    out: Any,
    out_dtype: torch.dtype | None,
    accumulate: bool,
) -> Call:
    """Validate ``wgrad`` arguments: dy (M, N), x (M, K), out (G, N, K) or G x (N, K).

    dy and x may be MXTensors blocked along M (each group a whole number of blocks).
    """
    # A dense 2-D tensor passes check_operand: the common case tested inline (it runs on
    # every backward step), anything else goes through it.
    if not (isinstance(dy, torch.Tensor) and dy.dim() == 2 and not dy.is_nested):
        check_operand(dy, "dy", "(M, N)")
    if not (isinstance(x, torch.Tensor) and x.dim() == 2 and not x.is_nested):
        check_operand(x, "x", "(M, K)")
    if not isinstance(accumulate, bool):
        raise InvalidTypeError("accumulate", accumulate, "True or False")
    m, n = dy.shape
    rows, k = x.shape
    if rows != m:
        raise ShapeError("x", x, f"(M, K) with M={m} rows like dy")
    device = dy.device
    if x.device != device:
        if device_kind(device) == "meta":  # the operand without data is at fault, not x
            raise DeviceMismatchError("dy", dy, META_REFUSAL)
        raise DeviceMismatchError("x", x, f"a tensor on {device}, like the other operands")
    kind = device_kind(device)
    # check_operand_kind only where it has something to refuse: a meta device, or what
    # ``_unusual`` finds (as in fwd_or_dgrad).
    if kind == "meta" or _unusual(dy, x):
        check_operand_kind([(name, t) for name, t in (("dy", dy), ("x", x)) if isinstance(t, torch.Tensor)])
    if kind == "meta":  # both MXTensors (a plain meta operand was refused just above)
        raise DeviceMismatchError("dy", dy, META_REFUSAL)
    groups = group_count(m_splits)
    splits, host = splits_operand(m_splits, groups, m, "dy", device)
    if isinstance(dy, MXTensor) or isinstance(x, MXTensor):
        # The formats and blocking axes first: whole blocks per group only mean something
        # for operands the recipe takes (MX operands in wgrad are rare; no memo needed).
        resolve_recipe("wgrad", recipe, dy, "dy", x, "x")
        check_row_blocks(splits, host, (("dy", dy), ("x", x)))
    if out is None and not accumulate:
        is_list = False  # wgrad_out's common case: nothing to check
    else:
        out, is_list = wgrad_out(out, groups, n, k, device, accumulate, (("dy", dy), ("x", x)))
    m_align, max_rows = split_facts(splits if host else None, m_align_cap=registry().max_m_multiple)
    capturing = kind == "cuda" and stream_capturing()
    key = _new_key(
        CallKey,
        (
            "wgrad",
            recipe,
            dy.dtype if isinstance(dy, torch.Tensor) else mx_format(dy),
            x.dtype if isinstance(x, torch.Tensor) else mx_format(x),
            out_dtype,
            None if out is None else first(out).dtype,
            groups,
            m_bucket(m),
            n,
            k,
            device,
            host,
            m_align,
            max_rows,
            is_list,
            accumulate,
            dy.is_contiguous() and x.is_contiguous(),
            capturing,
        ),
    )
    return Call(key, m, GroupedInputs(dy, x, splits, list(out) if is_list else out, ends_cache(m_splits), capturing))


#: Why a meta operand is refused (plain or MX).
META_REFUSAL = "a tensor with data (CPU or GPU); meta tensors have none"


def _unusual(a: Any, b: Any) -> bool:
    """Whether ``check_operand_kind`` has something to look at in either operand: a tensor
    that requires grad or is not dense (an MXTensor holds dense tensors that do not). Both
    in one call: it runs on every call."""
    return (isinstance(a, torch.Tensor) and (a.requires_grad or a.layout is not _STRIDED)) or (
        isinstance(b, torch.Tensor) and (b.requires_grad or b.layout is not _STRIDED)
    )


def _tensor_operands(a_arg: str, a: Any, w: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every plain-tensor operand: ``a``, and ``w`` or each ``w[i]`` of
    its list (an error names the group's weight at fault)."""
    weights = [(f"w[{i}]", t) for i, t in enumerate(w)] if isinstance(w, list) else [("w", w)]
    return [(name, t) for name, t in [(a_arg, a), *weights] if isinstance(t, torch.Tensor)]


# ---- operands -----------------------------------------------------------------------------


def refuse_nested(argument: str, value: torch.Tensor, dims: str) -> None:
    """A nested tensor has the strided layout and a dim() that counts its components' dims
    plus one, so it passes layout and rank checks; its shape then raises inside torch."""
    if value.is_nested:
        raise InvalidArgumentError(argument, value, f"a dense tensor of shape {dims}, not a nested tensor")


def check_tensor(value: Any, argument: str, ndim: int, dims: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidTypeError(argument, value, f"a torch.Tensor of shape {dims}")
    refuse_nested(argument, value, dims)
    if value.dim() != ndim:
        raise ShapeError(argument, value, f"a {ndim}-D tensor of shape {dims}, got {value.dim()}-D")
    return value


def check_operand(t: Any, argument: str, dims: str) -> None:
    """Type and rank of one operand, a tensor or an MXTensor."""
    if isinstance(t, MXTensor):
        if t.ndim != len(dims.split(",")):
            raise ShapeError(argument, t, f"an MXTensor of logical shape {dims}, got shape {t.shape}")
    else:
        check_tensor(t, argument, len(dims.split(",")), dims)


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
            raise DeviceMismatchError(name, t, META_REFUSAL)
        if t.requires_grad and torch.is_grad_enabled():
            raise InvalidArgumentError(
                name,
                t,
                "a tensor that does not require grad: the functional grouped GEMMs are not differentiable; "
                "use gg.grouped_linear / gg.GroupedLinear for autograd, or call under torch.no_grad()",
            )


def check_grouped_matrices(value: Any, argument: str) -> tuple[Any, int, int, int, bool]:
    """(value, G, N, K, is_list) for a (G, N, K) tensor or a list of G (N, K) tensors of
    one shape, dtype and device (a weight, or wgrad's ``out``)."""
    if isinstance(value, torch.Tensor):
        check_tensor(value, argument, 3, "(G, N, K)")
        g, n, k = value.shape
        if g < 1:
            raise ShapeError(argument, value, "at least one group (G >= 1)")
        return value, g, n, k, False
    if isinstance(value, (list, tuple)) and value:
        head = check_tensor(value[0], f"{argument}[0]", 2, "(N, K)")
        what = "weight" if argument == "w" else argument
        checks = (
            ("shape", ShapeError, f"every group's {what} has shape {{}}"),
            ("dtype", DTypeError, f"every group's {what} has dtype {{}}"),
            ("device", DeviceMismatchError, f"every group's {what} is on {{}}"),
        )
        for i, item in enumerate(value[1:], 1):
            t = check_tensor(item, f"{argument}[{i}]", 2, "(N, K)")
            for attr, error, allowed in checks:
                want = getattr(head, attr)
                if getattr(t, attr) == want:
                    continue
                bad, at = t, i
                later = value[2] if i == 1 and len(value) > 2 else None
                if isinstance(later, torch.Tensor) and getattr(later, attr) == getattr(t, attr):
                    bad, at, want = head, 0, getattr(t, attr)  # w[0] is the odd one out, not w[1]
                shown = tuple(want) if attr == "shape" else want
                raise error(f"{argument}[{at}]", bad, allowed.format(shown))
        n, k = head.shape
        return list(value), len(value), n, k, True
    raise InvalidTypeError(argument, value, "a (G, N, K) tensor or a non-empty list of G (N, K) tensors")


def first(t: Any) -> Any:
    """An operand's first tensor: the operand itself, or a list's first item."""
    return t[0] if isinstance(t, list) else t


def all_contiguous(*operands: Any) -> bool:
    for t in operands:
        if isinstance(t, list):
            if not all(i.is_contiguous() for i in t):
                return False
        elif not t.is_contiguous():
            return False
    return True


def operand_format(t: Any) -> str:
    """What ``Problem`` records for an operand: its dtype's name, or ``"mx_<fmt>"``."""
    return t.problem_format if isinstance(t, MXTensor) else dtype_name(t.dtype)


def default_out_dtype(a: Any) -> torch.dtype:
    """The result dtype when none is asked for: ``a``'s dtype, bf16 for an MXTensor ``a``."""
    return torch.bfloat16 if isinstance(a, MXTensor) else a.dtype


# ---- splits -------------------------------------------------------------------------------


def splits_operand(
    m_splits: Any, groups: int, rows: int, rows_arg: str, device: torch.device
) -> tuple[tuple[int, ...] | torch.Tensor, bool]:
    """(splits, on_host): a tuple of ints, or a device tensor.

    A ``GroupOffsets`` is taken as its ``splits`` tensor (whose total, when known on the
    host, is checked against ``rows`` here at no cost)."""
    if type(m_splits) is GroupOffsets:
        if m_splits.written():
            raise SplitsError(
                "m_splits",
                m_splits,
                "gg.offsets(...) as built: its splits or ends were written in place since, so its ends "
                "no longer match its sizes (new sizes take a new gg.offsets)",
            )
        if m_splits.total is not None and m_splits.total != rows:
            raise SplitsError(
                "m_splits",
                m_splits,
                f"group sizes summing to {rows_arg}.shape[0]={rows}, but they sum to {m_splits.total}",
            )
        # gg.offsets checked its tensor's rank and dtype and keeps it private: only the
        # call's own facts are left to check, the hot path of a reused GroupOffsets.
        if (
            m_splits.device == device
            and not m_splits.splits.is_cpu  # CPU splits are read back as host splits, below
            and m_splits.groups == groups
            and not config.settings().check_device_splits
        ):
            return m_splits.splits, False
        m_splits = m_splits.splits
    elif isinstance(m_splits, (list, tuple)):
        return _host_splits(m_splits, groups, rows, rows_arg), True
    if not isinstance(m_splits, torch.Tensor):
        raise splits_type_error(m_splits)
    # ``check_split_tensor``'s condition, inline: this runs on every device-splits call.
    if m_splits.dim() != 1 or m_splits.dtype not in SPLIT_DTYPES or m_splits.layout is not _STRIDED:
        raise SplitsError("m_splits", m_splits, split_tensor_refusal(m_splits))
    if m_splits.numel() != groups:
        raise SplitsError("m_splits", m_splits, f"one entry per group: expected {groups}, got {m_splits.numel()}")
    where = m_splits.device  # each read builds a torch.device: once
    if where.type == "cpu":
        return _host_splits(m_splits.tolist(), groups, rows, rows_arg), True
    if where.type == "meta":
        raise SplitsError("m_splits", m_splits, "a tensor with data (on the CPU or the operands' device), not meta")
    if where != device:
        raise DeviceMismatchError("m_splits", m_splits, f"on the operands' device {device} or on the CPU")
    if config.settings().check_device_splits:
        assert_device_splits(m_splits, rows, rows_arg)
    return m_splits, False


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
        values = as_ints(values)
        total, lowest = sum(values), min(values)
    if lowest < 0:
        index = values.index(lowest)
        raise SplitsError("m_splits", values, f"non-negative group sizes; m_splits[{index}]={lowest}")
    if total != rows:
        raise SplitsError(
            "m_splits", values, f"group sizes summing to {rows_arg}.shape[0]={rows}, but they sum to {total}"
        )
    return tuple(values)


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


def assert_device_splits(m_splits: torch.Tensor, rows: int, rows_arg: str) -> None:
    """Asynchronous device asserts that the splits are group sizes summing to ``rows``.

    Every entry is checked to lie in ``[0, rows]`` before the sum is trusted: with that
    bound the int64 sum of G entries cannot wrap (it would need G * rows >= 2**63), so
    entries like ``[2**63 - 1, 2**63 - 1, 12]`` cannot fake a matching sum."""
    in_range = ((m_splits >= 0) & (m_splits <= rows)).all()
    torch._assert_async(in_range, f"grouped_gemm: an m_splits entry is outside [0, {rows_arg}.shape[0]={rows}]")
    total = m_splits.sum(dtype=torch.int64)
    torch._assert_async(total == rows, f"grouped_gemm: m_splits does not sum to {rows_arg}.shape[0]={rows}")


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


# ---- outputs and bias ---------------------------------------------------------------------


def check_out(out: Any, shape: tuple[int, ...], device: torch.device, dims: str, operands: tuple = ()) -> None:
    """``out`` has the result's shape, the operands' device, and none of their memory."""
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise InvalidTypeError("out", out, f"a torch.Tensor of shape {dims}={shape}")
    refuse_nested("out", out, f"{dims}={shape}")
    if tuple(out.shape) != shape:
        raise ShapeError("out", out, f"shape {dims}={shape}")
    if out.device != device:
        raise DeviceMismatchError("out", out, f"a tensor on {device}, like the operands")
    if not out.is_contiguous():
        raise InvalidArgumentError("out", out, "a contiguous tensor")
    _check_out_grad("out", out)
    check_no_overlap([out], operands)


def wgrad_out(
    out: Any, groups: int, n: int, k: int, device: torch.device, accumulate: bool, operands: tuple = ()
) -> tuple[Any, bool]:
    """(out, is_list) for wgrad's ``out``: None, a (G, N, K) tensor, or G (N, K) tensors."""
    is_list = isinstance(out, (list, tuple))
    if is_list:
        out, g_out, n_out, k_out, _ = check_grouped_matrices(out, "out")
        if (g_out, n_out, k_out) != (groups, n, k):
            raise ShapeError("out", out[0], f"G={groups} tensors of shape (N, K)={(n, k)}")
        if out[0].device != device:
            raise DeviceMismatchError("out", out[0], f"a tensor on {device}, like the other operands")
        for i, t in enumerate(out):
            if not t.is_contiguous():
                raise InvalidArgumentError(f"out[{i}]", t, "a contiguous tensor, like every group's out")
            _check_out_grad(f"out[{i}]", t)
        check_no_overlap(out, operands)
    else:
        check_out(out, (groups, n, k), device, "(G, N, K)", operands)
    if accumulate and out is None:
        raise InvalidArgumentError("accumulate", True, "accumulate=True needs out= (the buffer to add into)")
    return out, is_list


def _check_out_grad(name: str, out: torch.Tensor) -> None:
    """An ``out`` buffer is written in place: one that requires grad (with grad mode on)
    would fail inside the backend, so it is refused here, naming the buffer."""
    if out.requires_grad and torch.is_grad_enabled():
        raise InvalidArgumentError(
            name, out, "a buffer that does not require grad: the functional grouped GEMMs write out= in place"
        )
    check_writable(name, out)


def check_writable(name: str, out: torch.Tensor) -> None:
    """A buffer written in place may not be an inference tensor outside inference mode:
    torch refuses that write inside the backend, which came back as that backend's
    BackendRunError instead of an error naming the buffer."""
    if out.is_inference() and not torch.is_inference_mode_enabled():
        raise InvalidArgumentError(
            name,
            out,
            "a buffer that can be written here: it is an inference tensor (made under torch.inference_mode()), "
            "which torch writes in place only inside inference mode; pass a normal tensor or call inside it",
        )


def out_dtype_name(out_dtype: torch.dtype | None, out: Any, default: torch.dtype) -> str:
    """The result dtype's name: ``out``'s, else ``out_dtype`` (a torch.dtype or its name),
    else ``default``."""
    # Type first: dtype_name looks the value up in a dict, where a list or a dict raised a
    # bare "unhashable type" TypeError that named no argument.
    if out_dtype is not None and (
        not isinstance(out_dtype, (torch.dtype, str)) or dtype_name(out_dtype) not in FLOAT_DTYPE_NAMES
    ):
        raise DTypeError("out_dtype", out_dtype, "torch.bfloat16, torch.float16 or torch.float32")
    if out is not None:
        dt = first(out).dtype
        # By name: out_dtype="float32" agrees with a float32 out.
        if out_dtype is not None and dtype_name(dt) != dtype_name(out_dtype):
            raise DTypeError("out", first(out), f"dtype out_dtype={out_dtype}")
        if dtype_name(dt) not in FLOAT_DTYPE_NAMES:
            raise DTypeError("out", first(out), "dtype bfloat16, float16 or float32")
        return dtype_name(dt)
    return dtype_name(out_dtype or default)


class Region(NamedTuple):
    """A tensor's memory in an overlap check; ``written`` marks a buffer written in place."""

    name: str
    tensor: torch.Tensor
    written: bool


def _span(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(device index, first byte, end byte) a tensor can touch; None when it has no elements
    or no memory (meta: every data pointer is 0, so all of them seemed to overlap).

    Keyed by device (``get_device()``: -1 on the CPU), not by storage: tensors made over
    one buffer by numpy, DLPack or ``torch.frombuffer`` share memory through distinct
    storages, whose overlap a same-storage test missed (out= then overwrote rows of x not
    yet read)."""
    if t.numel() == 0 or t.is_meta:
        return None
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    start = t.data_ptr()
    return t.get_device(), start, start + (extent + 1) * t.element_size()


def first_overlap(regions: Sequence[Region]) -> tuple[Region, Region] | None:
    """(a written region, one it shares memory with), or None; regions that are only read
    may overlap each other. One sweep over byte ranges sorted by start: a range starting
    before the furthest end so far overlaps the range reaching it, and the first overlap of
    a written region is always found so (it starts inside the furthest range, or a later
    range starts inside it while it is the furthest)."""
    spans = [(span, region) for region in regions if (span := _span(region.tensor)) is not None]
    spans.sort(key=lambda item: item[0][:2])
    furthest: tuple[tuple[int, int, int], Region] | None = None
    for span, region in spans:
        if furthest is None or furthest[0][0] != span[0]:
            furthest = span, region
            continue
        if span[1] < furthest[0][2] and (region.written or furthest[1].written):
            return (region, furthest[1]) if region.written else (furthest[1], region)
        if span[2] > furthest[0][2]:
            furthest = span, region
    return None


def check_no_overlap(outs: Sequence[torch.Tensor], operands: tuple) -> None:
    """InvalidArgumentError naming ``out`` when an output buffer shares memory with an
    input (the kernel would read what it already overwrote) or with another output
    buffer (``out=[buf] * G``: the groups would overwrite each other)."""
    names = [f"out[{i}]" if len(outs) > 1 else "out" for i in range(len(outs))]
    regions = [Region(name, o, True) for name, o in zip(names, outs, strict=True)]
    regions += [Region(name, t, False) for name, operand in operands for t in operand_tensors(operand)]
    found = first_overlap(regions)
    if found is None:
        return
    out, other = found
    if other.written:
        raise InvalidArgumentError(
            "out", out.tensor, f"G distinct buffers; {other.name} and {out.name} share memory (e.g. out=[buf] * G)"
        )
    raise InvalidArgumentError(
        "out", out.tensor, f"a buffer that shares no memory with the input {other.name}; {out.name} overlaps it"
    )


def check_bias(bias: Any, groups: int, n: int, like: torch.Tensor) -> None:
    """A ``(G, N)`` bias on ``like``'s device (``like``: the layer's input x), checked before
    any GEMM runs."""
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor):
        raise InvalidTypeError("bias", bias, f"a torch.Tensor of shape (G, N)={(groups, n)} or None")
    refuse_nested("bias", bias, f"(G, N)={(groups, n)}")
    if tuple(bias.shape) != (groups, n):
        raise ShapeError("bias", bias, f"shape (G, N)={(groups, n)}")
    if bias.device != like.device:
        if like.device.type == "meta":  # the layer's input is at fault, not its bias
            raise DeviceMismatchError("x", like, META_REFUSAL)
        raise DeviceMismatchError("bias", bias, f"a tensor on {like.device}, like the operands")
    if not bias.dtype.is_floating_point:
        raise DTypeError("bias", bias, "a floating-point tensor")


# ---- recipes ------------------------------------------------------------------------------


def resolve_recipe(op: Op, recipe: str | Recipe | None, a: Any, a_arg: str, b: Any, b_arg: str) -> Recipe:
    """The call's recipe, checked against its operands: ``recipe=None`` is the plain recipe
    of the operands' dtype, or the MX recipe their formats imply."""
    if isinstance(a, MXTensor) or isinstance(b, MXTensor):
        return _mx_recipe(op, recipe, a, a_arg, b, b_arg)
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
            if dtype_name(t.dtype) not in FLOAT_DTYPE_NAMES:
                raise DTypeError(name, t, f"recipe {resolved.name} quantizes bfloat16, float16 or float32 tensors")
    return resolved


# ---- MX operands --------------------------------------------------------------------------

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


def mx_format(t: MXTensor) -> tuple[str, int, int]:
    """What recipe resolution reads of an MXTensor operand: (fmt, axis, block size)."""
    return (t.fmt, t.axis, t.block_size)


def _mx_recipe(op: Op, recipe: str | Recipe | None, a: Any, a_arg: str, b: Any, b_arg: str) -> Recipe:
    """The recipe against operands of which at least one is an MXTensor: inferred from
    their formats when None; each MX operand's format, blocking axis and block size must be
    the recipe's, each plain one a dtype it quantizes."""
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
            allowed = FLOAT_DTYPE_NAMES if resolved.plain_dtype is None else (resolved.plain_dtype,)
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


def check_row_blocks(splits: Sequence[int] | torch.Tensor, host: bool, operands: tuple[tuple[str, Any], ...]) -> None:
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
