"""Per-call facts about torch devices and streams, read cheaply.

The call path asks them on every call (issue 14's host time): ``device.type`` builds a
new str on every read (about 0.2 us on the dev CPU) and ``torch.cuda.is_current_stream_capturing``
is a Python frame around a C function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: torch.device -> its type (a process sees a handful of devices).
_DEVICE_KINDS: dict[torch.device, str] = {}


def device_kind(device: torch.device) -> str:
    """``device.type`` ("cuda", "cpu", "meta"...), from a per-process table."""
    kind = _DEVICE_KINDS.get(device)
    if kind is None:
        kind = _DEVICE_KINDS[device] = device.type
    return kind


#: Whether the current CUDA stream is capturing a graph: the C function
#: ``torch.cuda.is_current_stream_capturing`` wraps. Call it only for CUDA devices (a
#: CPU-only torch has a stub that raises).
stream_capturing: Callable[[], bool] = getattr(
    torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing
)


def capturing_on(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream (False off
    CUDA). For paths off the per-call hot path; the call path, which already knows the
    device's kind, asks ``stream_capturing`` itself."""
    return device_kind(device) == "cuda" and stream_capturing()
