"""GroupedInputs: the validated operands a backend's ``run`` receives.

Holds the data ``Problem`` leaves out, plus the helpers every backend needs in one place
(host splits, device offsets), so backends do not each re-derive them.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from grouped_gemm.group_ends import group_ends
from grouped_gemm.group_offsets import host_to_device
from grouped_gemm.torch_device import device_kind, stream_capturing

if TYPE_CHECKING:
    from grouped_gemm.problem import Problem


@dataclasses.dataclass(slots=True)
class GroupedInputs:
    """Operands of one call, already validated by the core.

    ``a`` / ``b`` follow ``Problem``'s table (fwd: x, w; dgrad: dy, w; wgrad: dy, x).
    ``b`` (fwd, dgrad) or ``out`` (wgrad) may be a list of G tensors when
    ``Problem.weight_list`` is set. ``out`` is the caller's buffer or None; a backend
    writes into it when given (and must when ``Problem.accumulate``) and returns the
    result either way. ``m_splits`` is a tuple of ints (immutable: a backend cannot change
    the caller's list) or a 1-D integer tensor. ``_offsets`` caches ``offsets``; validation
    seeds it with the ends of a ``gg.offsets`` result, so no call recomputes them.
    ``capturing``: whether the call runs under CUDA-graph capture, as validation found it
    (None: asked of torch where it matters), so the call path asks once.
    """

    a: Any
    b: Any
    m_splits: tuple[int, ...] | torch.Tensor
    out: Any = None
    _offsets: dict = dataclasses.field(default_factory=dict, repr=False)
    capturing: bool | None = None

    def output(self, problem: Problem) -> Any:
        """Where the result goes: ``out`` when the caller gave one, else a new uninitialized
        tensor of ``problem.out_shape`` and ``out_dtype`` on the operands' device."""
        if self.out is not None:
            return self.out
        # The sizes as separate arguments: torch parses them ~0.4 us faster than one tuple.
        return torch.empty(*problem.out_shape, dtype=problem.out_torch_dtype, device=self.a.device)

    def splits_list(self) -> list[int]:
        """Group sizes on the host, a fresh list (a device-to-host sync if they live on
        the device)."""
        if isinstance(self.m_splits, torch.Tensor):
            return [int(v) for v in self.m_splits.tolist()]
        return list(self.m_splits)

    def offsets(self, device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """Cumulative group ends ``[m0, m0+m1, ..., M]`` (length G) on ``device``.

        From device splits this is one small scan kernel straight into ``dtype``
        (``group_ends``: no host sync, no separate conversion kernel). From host
        splits the ends are summed in Python and sent in one copy, non-blocking from pinned
        memory when ``device`` is a GPU (torch's caching host allocator keeps the pinned
        buffer alive until the copy has run). Cached per (device, dtype) for the call.
        """
        key = (device, dtype)
        cached = self._offsets.get(key)
        if cached is not None:
            return cached
        splits = self.m_splits
        if isinstance(splits, torch.Tensor):
            if splits.device != device:
                splits = splits.to(device)
            ends = group_ends(splits, dtype)
        else:
            ends = host_ends(splits, device, dtype, self.capturing)
        self._offsets[key] = ends
        return ends


#: Device ends (or sizes, ``host_sizes``) of the latest host splits, per (splits, which of
#: the two, device, dtype, stream). A MoE layer's GEMMs share one ``m_splits`` (two or
#: three forward, up to six backward), so all but the first skip the pinned copy. Keyed
#: by stream: a tensor written on one stream is only read on that stream, so no reader can
#: outrun its copy, and once dropped it goes back to the allocator on the stream that used
#: it. Never filled under graph capture (a capture's memory belongs to its graph).
#: Read-only for backends, like every input.
_RECENT_ENDS: dict[tuple, torch.Tensor] = {}
_RECENT_ENDS_MAX = 16


def host_ends(
    splits: Sequence[int], device: torch.device, dtype: torch.dtype = torch.int32, capturing: bool | None = None
) -> torch.Tensor:
    """Cumulative ends of host ``splits`` on ``device``, summed in Python, sent in one copy
    (none when the same splits were sent on this stream lately, on a GPU). ``capturing``:
    whether the current stream is capturing a CUDA graph, if the caller knows already."""
    return _recent_copy(splits, True, device, dtype, capturing)


def host_sizes(
    splits: Sequence[int], device: torch.device, dtype: torch.dtype = torch.int32, capturing: bool | None = None
) -> torch.Tensor:
    """Host ``splits`` themselves on ``device``, for kernels that sum them there (the Triton
    MX ones), sent as ``host_ends`` sends ends: one pinned copy, none when the same splits
    went to this stream lately (a pageable copy a call otherwise, issue 14)."""
    return _recent_copy(splits, False, device, dtype, capturing)


def _recent_copy(
    splits: Sequence[int], ends: bool, device: torch.device, dtype: torch.dtype, capturing: bool | None
) -> torch.Tensor:
    """``splits`` (``ends``: their cumulative ends) on ``device`` through ``_RECENT_ENDS``."""
    key = None
    # Written out (no helper frames): it runs on every call given host splits (issue 14).
    if (
        device_kind(device) == "cuda"
        and type(splits) is tuple
        and not (stream_capturing() if capturing is None else capturing)
    ):
        # The raw stream handle: ``torch.cuda.current_stream(device)`` builds a Stream
        # object, ~5 us of host time a call on the H200 host (cProfile, issue 14).
        index = device.index
        stream = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device() if index is None else index)
        key = (splits, ends, device, dtype, stream)
        sent = _RECENT_ENDS.get(key)
        if sent is not None:
            return sent
    sent = host_to_device(list(itertools.accumulate(splits)) if ends else list(splits), device, dtype)
    if key is not None:
        if len(_RECENT_ENDS) >= _RECENT_ENDS_MAX:
            _RECENT_ENDS.clear()  # bounded; a step's splits come back on its next call
        _RECENT_ENDS[key] = sent
    return sent
