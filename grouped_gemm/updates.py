"""Write counts of tensors, with the writes torch does not count declared (``gg.mark_updated``).

What the library derives from a tensor and keeps (the Hopper kernels' layout of a
pre-quantized ``MXTensor`` weight, ``GroupedLinear.freeze_quantized_weights``' copy, the ends
of ``gg.offsets``) is invalidated when the tensor is written in place, which torch counts in
its version (``tensor._version``). Some writes are not counted: ``torch.distributed``
collectives into a tensor (``broadcast``, ``all_reduce``: a trainer syncing weights into a
server), writes through ``.data``, numpy or DLPack aliases, copies into the storage, and any
write to an inference tensor (``torch.inference_mode``), which keeps no version at all.
``gg.mark_updated`` declares such writes (``count_writes``); ``write_stamp`` is what the
caches compare.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import torch

# Declared writes by tensor id; an entry is dropped when its tensor is collected (so an id
# reused later starts from none). Not a WeakKeyDictionary: its weak references compare
# their tensors with ``==``, which is elementwise for tensors.
_declared: dict[int, int] = {}
_lock = threading.Lock()


def count_writes(tensors: Iterable[torch.Tensor]) -> None:
    """Count one declared write to each tensor."""
    with _lock:
        for t in tensors:
            key = id(t)
            if key not in _declared:
                weakref.finalize(t, _declared.pop, key, None)
            _declared[key] = _declared.get(key, 0) + 1


def write_stamp(t: torch.Tensor) -> tuple[int, int]:
    """What a cache of something derived from ``t`` keys on: torch's count of in-place
    writes (-1 for an inference tensor, which keeps none) and the declared writes."""
    try:
        version = t._version
    except RuntimeError:  # an inference tensor (tested this way: no extra call on the hot path)
        version = -1
    return version, (_declared.get(id(t), 0) if _declared else 0)
