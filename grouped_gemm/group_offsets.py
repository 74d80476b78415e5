"""``gg.offsets``: group sizes and their int32 ends, computed once and reused.

A MoE layer runs three grouped GEMMs per step with the same ``m_splits`` (gate/up, down,
and the backward ones); each call would otherwise rebuild the cumulative group ends the
kernels read (a cumsum, or a host-to-device copy for host splits). ``gg.offsets(m_splits)``
does that once; the result is accepted wherever ``m_splits`` is, and behaves exactly like
its ``splits`` tensor would (device-resident: device splits on a GPU, read back as host
splits on the CPU), except that the ends are not recomputed.

Host group sizes are parsed here too (``host_split_ints``), once for every caller:
validation, ``gg.offsets`` and ``quantize_mx_rows``.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Sequence
from typing import Any

import torch

from grouped_gemm.errors import DeviceMismatchError, InvalidArgumentError, InvalidTypeError, SplitsError
from grouped_gemm.group_ends import copy_and_ends, group_ends
from grouped_gemm.updates import DECLARED, write_stamp
from grouped_gemm.vocabulary import SPLIT_DTYPES, SPLIT_TENSOR


def host_to_device(values: list[int], device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """``values`` as a tensor on ``device`` in one H2D copy, non-blocking from pinned memory
    when ``device`` is a CUDA or ROCm GPU (pinning needs one, so other targets take a plain
    tensor). torch's caching host allocator keeps the pinned buffer until the copy ran."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def split_tensor_refusal(t: torch.Tensor) -> str:
    """What a group-size tensor must be, as an error says it; a sparse one's layout named
    (its rank and dtype pass, and reading it failed inside torch, naming no argument)."""
    if t.layout != torch.strided:
        return f"{SPLIT_TENSOR} with the strided (dense) layout, got {t.layout}; call .to_dense()"
    return SPLIT_TENSOR


def check_split_tensor(t: torch.Tensor, argument: str) -> None:
    """Refuse a group-size tensor that is not 1-D, of a split dtype and dense (validation's
    per-call path tests the same condition inline)."""
    if t.dim() != 1 or t.dtype not in SPLIT_DTYPES or t.layout != torch.strided:
        raise SplitsError(argument, t, split_tensor_refusal(t))


#: The ends and row offsets are int32 (what the kernels take), so row counts must fit.
MAX_ROWS = 2**31 - 1


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class GroupOffsets:
    """Group sizes and their cumulative ends, on one device. Build it with ``gg.offsets``.

    ``splits``: (G,) integer group sizes (a private copy: later edits of the caller's list or
    tensor do not reach it). ``ends``: (G,) int32 ``[m0, m0+m1, ..., M]`` on the same device.
    ``total``: the row count when the sizes were known on the host (then checked against M
    on every call for free), else None. Both tensors are read-only: ``ends`` and ``total``
    would no longer match edited sizes, so a call given offsets whose tensors were written
    in place since (``write_stamp``) is refused; new sizes take a new ``gg.offsets``.
    Built by hand, its parts must agree (``_check_parts``; values compared on the CPU only).
    """

    splits: torch.Tensor
    ends: torch.Tensor
    total: int | None
    versions: tuple[tuple[int, int], tuple[int, int]] = dataclasses.field(init=False, repr=False)
    #: Where ``GroupedInputs.offsets`` files ``ends``: (device, int32), built once.
    ends_key: tuple[torch.device, torch.dtype] = dataclasses.field(init=False, repr=False)
    #: The tensors' device and the group count, read once: every call given these offsets
    #: checks both (a read of ``Tensor.device`` or ``shape`` costs ~0.1 us of host time).
    device: torch.device = dataclasses.field(init=False, repr=False)
    groups: int = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check_parts(self.splits, self.ends, self.total)
        self._read_facts()

    def _read_facts(self) -> None:
        """The write stamps, device and group count, read once when built."""
        object.__setattr__(self, "versions", (write_stamp(self.splits), write_stamp(self.ends)))
        device = self.splits.device
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "groups", self.splits.shape[0])
        object.__setattr__(self, "ends_key", (device, torch.int32))

    def written(self) -> bool:
        """Whether ``splits`` or ``ends`` was written in place since they were built (as
        torch counts writes, or ``gg.mark_updated`` declares them)."""
        if not DECLARED:
            # No write declared anywhere, so none to these tensors, then or now (an entry
            # lives as long as its storage): torch's counts decide, without two
            # ``write_stamp`` frames (every call given offsets asks, issue 14).
            (splits_version, _), (ends_version, _) = self.versions
            try:
                return self.splits._version != splits_version or self.ends._version != ends_version
            except RuntimeError:  # inference tensors keep no count: write_stamp says so
                pass
        return (write_stamp(self.splits), write_stamp(self.ends)) != self.versions

    def __len__(self) -> int:
        return self.groups

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Copies and pickles rebuild the read facts (``_rebuilt``): the stamps count writes
        to these tensors, and ``deepcopy`` and ``pickle`` give new tensors whose count starts
        at 1, so a copied module's offsets were refused as written in place on every call."""
        return _rebuilt, (self.splits, self.ends, self.total, self.written())


#: A write stamp no tensor has (versions are >= -1, declared writes >= 0).
_NEVER_STAMPED = ((-2, -1), (-2, -1))


def _rebuilt(splits: torch.Tensor, ends: torch.Tensor, total: int | None, written: bool) -> GroupOffsets:
    """A copied or unpickled ``GroupOffsets``: its parts checked like one built by hand (a
    pickle may come from anywhere), or, when the original had been written in place, kept
    refused as it was."""
    if not written:
        return GroupOffsets(splits, ends, total)
    made = _agreeing(splits, ends, total)
    object.__setattr__(made, "versions", _NEVER_STAMPED)
    return made


def _agreeing(splits: torch.Tensor, ends: torch.Tensor, total: int | None) -> GroupOffsets:
    """A ``GroupOffsets`` from parts that agree by construction (``offsets`` builds them):
    without ``_check_parts``, which doubles ``gg.offsets``' host time on CPU splits."""
    made = object.__new__(GroupOffsets)
    object.__setattr__(made, "splits", splits)
    object.__setattr__(made, "ends", ends)
    object.__setattr__(made, "total", total)
    made._read_facts()
    return made


def _check_parts(splits: Any, ends: Any, total: Any) -> None:
    """The parts of a ``GroupOffsets`` built by hand agree (``gg.offsets`` builds them so):
    backends take ``ends`` as given, so ends that are not the cumulative sum of ``splits``
    gave other backends' numbers without an error. Values are compared on the CPU only,
    where reading them costs no device sync."""
    if (
        not isinstance(splits, torch.Tensor)
        or splits.dim() != 1
        or splits.dtype not in SPLIT_DTYPES
        or splits.layout != torch.strided
    ):
        allowed = split_tensor_refusal(splits) if isinstance(splits, torch.Tensor) else SPLIT_TENSOR
        raise SplitsError("splits", splits, f"{allowed}; build GroupOffsets with gg.offsets(m_splits)")
    if (
        not isinstance(ends, torch.Tensor)
        or ends.layout != torch.strided
        or ends.dtype != torch.int32
        or tuple(ends.shape) != tuple(splits.shape)
        or ends.device != splits.device
    ):
        layout = getattr(ends, "layout", torch.strided)
        raise SplitsError(
            "ends",
            ends,
            f"a dense ({splits.shape[0]},) int32 tensor on {splits.device}, the running sum of splits"
            f"{'' if layout == torch.strided else f' (got layout {layout})'}; "
            "build GroupOffsets with gg.offsets(m_splits)",
        )
    if total is not None and (isinstance(total, bool) or not isinstance(total, int)):
        raise SplitsError("total", total, "None or an int, the sum of splits")
    if splits.device.type == "cpu":
        running = splits.to(torch.int64).cumsum(0)
        if not torch.equal(ends.to(torch.int64), running):
            raise SplitsError(
                "ends",
                ends.tolist(),
                f"the running sum of splits={splits.tolist()}, {running.tolist()}; build GroupOffsets with "
                "gg.offsets(m_splits)",
            )
        if total is not None and total != (int(running[-1]) if splits.numel() else 0):
            raise SplitsError("total", total, f"None or the sum of splits={splits.tolist()}")


def ends_cache(m_splits: Any) -> dict[tuple[torch.device, torch.dtype], torch.Tensor]:
    """The ends ``GroupedInputs.offsets`` can hand out without a kernel: a seed for its
    cache when ``m_splits`` is a ``GroupOffsets``, else empty."""
    if type(m_splits) is GroupOffsets:
        return {m_splits.ends_key: m_splits.ends}
    return {}


def offsets(m_splits: Any, device: torch.device | str | None = None) -> GroupOffsets:
    """``m_splits`` (a list/tuple of ints or a 1-D integer tensor) with its int32 ends, on
    ``device`` (default: the tensor's device, or the CPU for a list).

    Device tensors cost one small kernel (the copy and the ends, ``group_ends``) and no
    host sync; host sizes are checked here (non-negative ints) and sent in one copy, from
    pinned memory on a GPU. Call it once per step and pass the result as ``m_splits`` to
    the step's GEMMs.
    """
    target = None if device is None else visible_device(device)
    if isinstance(m_splits, GroupOffsets):
        if target is None or target == m_splits.device:
            return m_splits
        raise DeviceMismatchError("device", device, f"{m_splits.device}, where these offsets already live")
    if target is not None and target.type == "meta":
        raise InvalidArgumentError("device", device, "a device with data (the CPU or a GPU), not meta")
    if isinstance(m_splits, torch.Tensor):
        check_split_tensor(m_splits, "m_splits")
        if m_splits.device.type == "meta":
            raise SplitsError("m_splits", m_splits, "a tensor with data (on the CPU or a GPU), not meta")
        if m_splits.device.type != "cpu":
            if target is None or target == m_splits.device:
                return _agreeing(*copy_and_ends(m_splits), None)
            splits = m_splits.to(target, copy=True)
            return _agreeing(splits, group_ends(splits), None)
        values = m_splits.tolist()
    elif isinstance(m_splits, (list, tuple)):
        values = host_split_ints(m_splits)
    else:
        raise SplitsError("m_splits", m_splits, "a list/tuple of ints or a 1-D integer tensor")
    return _from_host(values, target or torch.device("cpu"))


def visible_device(device: Any) -> torch.device:
    """``device`` (a torch.device, name or index) as a torch.device this process can use:
    a value torch cannot parse, or a GPU that is not there, is named as ``device=`` here,
    not in a RuntimeError or AssertionError from torch where the tensors move.

    Returned as a tensor on it reports its device (``"cpu:0"`` as ``cpu``, ``"cuda"`` with
    the current GPU's index), so comparing it with a tensor's device means "the same
    device": ``gg.offsets(offs, device="cpu:0")`` was refused as another device than cpu."""
    try:
        target = torch.device(device)
    except (TypeError, RuntimeError, ValueError):
        raise InvalidArgumentError(
            "device", device, "a torch.device, a name such as 'cpu' or 'cuda:0', or the index of a visible GPU"
        ) from None
    if target.type == "cuda":
        if (target.index or 0) >= torch.cuda.device_count():
            raise InvalidArgumentError(
                "device", device, f"a GPU this process sees ({torch.cuda.device_count()} visible)"
            )
        if target.index is None:
            return torch.device("cuda", torch.cuda.current_device())
    elif target.type == "cpu":
        return torch.device("cpu")
    return target


def _from_host(values: list[int], device: torch.device) -> GroupOffsets:
    """Both tensors from one buffer ``[splits..., ends...]``: one H2D copy."""
    if not values:
        raise SplitsError("m_splits", values, "at least one group")
    if min(values) < 0:
        index = values.index(min(values))
        raise SplitsError("m_splits", values, f"non-negative group sizes; m_splits[{index}]={values[index]}")
    total = sum(values)
    if total > MAX_ROWS:
        raise SplitsError("m_splits", values, f"at most {MAX_ROWS} rows in all (int32 ends), got {total}")
    groups = len(values)
    both = host_to_device([*values, *itertools.accumulate(values)], device)
    return _agreeing(both[:groups], both[groups:], total)


def as_ints(values: Sequence[Any], argument: str = "m_splits") -> list[int]:
    """Host group sizes as Python ints: ints, numpy integers and 1-element integer tensors
    with data; bools and floats are rejected."""
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or type(v).__name__ == "bool_":
            raise SplitsError(argument, values, f"integers; {argument}[{i}]={v!r} is a bool")
        if isinstance(v, torch.Tensor) and (v.dtype not in SPLIT_DTYPES or v.numel() != 1 or v.is_meta or v.is_nested):
            raise SplitsError(
                argument,
                values,
                f"integers; {argument}[{i}] is a tensor of dtype {v.dtype} with {v.numel()} elements on {v.device}",
            )
        try:
            out.append(operator.index(v))
        except TypeError:
            raise SplitsError(argument, values, f"integers; {argument}[{i}]={v!r} is a {type(v).__name__}") from None
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
    rejected."""
    if isinstance(values, torch.Tensor):
        check_split_tensor(values, argument)
        return values.tolist()
    if not isinstance(values, (list, tuple)):
        raise splits_type_error(values)
    return as_ints(values, argument)
