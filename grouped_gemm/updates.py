"""Write counts of tensors, with the writes torch does not count declared (``gg.mark_updated``).

What the library derives from a tensor and keeps (the Hopper kernels' layout of a
pre-quantized ``MXTensor`` weight, ``GroupedLinear.freeze_quantized_weights``' copy, the ends
of ``gg.offsets``) is invalidated when the tensor is written in place, which torch counts in
its version (``tensor._version``). Some writes are not counted: ``torch.distributed``
collectives into a tensor (``broadcast``, ``all_reduce``: a trainer syncing weights into a
server), writes through ``.data``, numpy or DLPack aliases, copies into the storage, and any
write to an inference tensor (``torch.inference_mode``), which keeps no version at all.
``gg.mark_updated`` declares such writes (``count_writes``) to a tensor's memory, so declaring
one on a flat buffer also covers the parameters that are views of it; ``write_stamp`` is what
the caches compare.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import torch

# Declared writes by storage (a tensor's memory): a write to a flat buffer concerns every
# tensor on it, such as parameters whose ``.data`` is a view of the buffer (Megatron-LM's
# DDP; their own version counters do not see the buffer's writes) and ``.data`` aliases.
# An entry is dropped when its storage is freed (so a key reused later starts from none).
# Not a WeakKeyDictionary: storages compare by value, not identity. Empty until the first
# ``gg.mark_updated``: hot paths that find it empty compare torch's counts alone
# (``GroupOffsets.written``). Mutated in place, never rebound.
DECLARED: dict[tuple[str, int], int] = {}
_lock = threading.Lock()


def _owner(t: torch.Tensor) -> tuple[tuple[str, int], object]:
    """The key of ``t``'s declared writes and the object whose lifetime bounds it: its
    storage, or ``t`` itself where it has none to read (sparse, nested, functional)."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return ("tensor", id(t)), t
    return ("storage", storage._cdata), storage


def count_writes(tensors: Iterable[torch.Tensor]) -> None:
    """Count one declared write to the memory of each tensor."""
    with _lock:
        for t in tensors:
            key, owner = _owner(t)
            if key not in DECLARED:
                weakref.finalize(owner, DECLARED.pop, key, None)
            DECLARED[key] = DECLARED.get(key, 0) + 1


def write_stamp(t: torch.Tensor) -> tuple[int, int]:
    """What a cache of something derived from ``t`` keys on: torch's count of in-place
    writes (-1 for an inference tensor, which keeps none) and the writes declared to its
    memory."""
    try:
        version = t._version
    except RuntimeError:  # an inference tensor (tested this way: no extra call on the hot path)
        version = -1
    return version, (DECLARED.get(_owner(t)[0], 0) if DECLARED else 0)
