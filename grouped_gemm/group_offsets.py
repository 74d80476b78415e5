"""``gg.offsets``: group sizes and their int32 ends, computed once and reused.

A MoE layer runs three grouped GEMMs per step with the same ``m_splits`` (gate/up, down,
and the backward ones); each call would otherwise rebuild the cumulative group ends the
kernels read (a cumsum, or a host-to-device copy for host splits). ``gg.offsets(m_splits)``
does that once; the result is accepted wherever ``m_splits`` is, and behaves exactly like
its ``splits`` tensor would (device-resident: device splits on a GPU, read back as host
splits on the CPU), except that the ends are not recomputed.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch

from grouped_gemm.errors import DeviceMismatchError, SplitsError
from grouped_gemm.inputs import host_to_device

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
#: The ends are int32 (what the kernels take), so the total number of rows must fit.
_MAX_ROWS = 2**31 - 1


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class GroupOffsets:
    """Group sizes and their cumulative ends, on one device. Build it with ``gg.offsets``.

    ``splits``: (G,) integer group sizes (a private copy: later edits of the caller's list or
    tensor do not reach it). ``ends``: (G,) int32 ``[m0, m0+m1, ..., M]`` on the same device.
    ``total``: the row count when the sizes were known on the host (then checked against M
    on every call for free), else None. Treat both tensors as read-only.
    """

    splits: torch.Tensor
    ends: torch.Tensor
    total: int | None

    @property
    def device(self) -> torch.device:
        return self.splits.device

    def __len__(self) -> int:
        return self.splits.shape[0]


def ends_cache(m_splits: Any) -> dict[tuple[torch.device, torch.dtype], torch.Tensor]:
    """The ends ``GroupedInputs.offsets`` can hand out without a kernel: a seed for its
    cache when ``m_splits`` is a ``GroupOffsets``, else empty."""
    if type(m_splits) is GroupOffsets:
        return {(m_splits.ends.device, torch.int32): m_splits.ends}
    return {}


def offsets(m_splits: Any, device: torch.device | str | None = None) -> GroupOffsets:
    """``m_splits`` (a list/tuple of ints or a 1-D integer tensor) with its int32 ends, on
    ``device`` (default: the tensor's device, or the CPU for a list).

    Device tensors cost two small kernels (a copy and one cumsum) and no host sync; host
    sizes are checked here (non-negative ints) and sent in one copy, from pinned memory on
    a GPU. Call it once per step and pass the result as ``m_splits`` to the step's GEMMs.
    """
    if isinstance(m_splits, GroupOffsets):
        if device is None or torch.device(device) == m_splits.device:
            return m_splits
        raise DeviceMismatchError("device", device, f"{m_splits.device}, where these offsets already live")
    target = torch.device(device) if device is not None else None
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dim() != 1 or m_splits.dtype not in _INT_DTYPES or m_splits.layout != torch.strided:
            raise SplitsError("m_splits", m_splits, "a 1-D integer tensor (int32 or int64)")
        if m_splits.device.type == "meta":
            raise SplitsError("m_splits", m_splits, "a tensor with data (on the CPU or a GPU), not meta")
        if m_splits.device.type != "cpu":
            splits = m_splits.to(target or m_splits.device, copy=True)
            return GroupOffsets(splits, torch.cumsum(splits, 0, dtype=torch.int32), None)
        values = m_splits.tolist()
    elif isinstance(m_splits, (list, tuple)):
        from grouped_gemm.arguments import host_split_ints  # arguments imports this module

        values = host_split_ints(m_splits)
    else:
        raise SplitsError("m_splits", m_splits, "a list/tuple of ints or a 1-D integer tensor")
    return _from_host(values, target or torch.device("cpu"))


def _from_host(values: list[int], device: torch.device) -> GroupOffsets:
    """Both tensors from one buffer ``[splits..., ends...]``: one H2D copy."""
    if not values:
        raise SplitsError("m_splits", values, "at least one group")
    if min(values) < 0:
        index = values.index(min(values))
        raise SplitsError("m_splits", values, f"non-negative group sizes; m_splits[{index}]={values[index]}")
    total = sum(values)
    if total > _MAX_ROWS:
        raise SplitsError("m_splits", values, f"at most {_MAX_ROWS} rows in all (int32 ends), got {total}")
    groups = len(values)
    both = host_to_device([*values, *itertools.accumulate(values)], device)
    return GroupOffsets(both[:groups], both[groups:], total)
