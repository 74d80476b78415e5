"""In-place writes that torch does not count, declared: ``gg.mark_updated``.

What the library derives from a weight and keeps (the Hopper kernels' layout of a
pre-quantized ``MXTensor`` weight, ``GroupedLinear.freeze_quantized_weights``' copy) is
invalidated when the weight's tensors are written in place, which torch counts in each
tensor's version (``tensor._version``). Some writes are not counted: ``torch.distributed``
collectives into a tensor (``broadcast``, ``all_reduce``: a trainer syncing weights into a
server), writes through ``.data``, numpy or DLPack aliases, copies into the storage, and any
write to an inference tensor (``torch.inference_mode``), which has no version at all.
``gg.mark_updated(weights)`` after such a write counts it: the next call rebuilds what it
had derived (a frozen ``GroupedLinear`` refuses to run until it is frozen again).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from grouped_gemm.errors import InvalidTypeError
from grouped_gemm.mx import MXTensor

# Declared writes by tensor id; an entry is dropped when its tensor is collected (so an id
# reused later starts from none). Not a WeakKeyDictionary: its weak references compare
# their tensors with ``==``, which is elementwise for tensors.
_declared: dict[int, int] = {}
_lock = threading.Lock()


def mark_updated(*weights: Any) -> None:
    """Count a write to each of ``weights`` (tensors, ``MXTensor``s, or lists / tuples of
    them) that torch did not count (see the module docstring): whatever the library derived
    from them is rebuilt, or refused, on the next call."""
    tensors = list(_tensors(weights, "weights"))
    with _lock:
        for t in tensors:
            key = id(t)
            if key not in _declared:
                weakref.finalize(t, _declared.pop, key, None)
            _declared[key] = _declared.get(key, 0) + 1


def write_stamp(t: torch.Tensor) -> tuple[int, int]:
    """What a cache of something derived from ``t`` keys on: torch's count of in-place
    writes (-1 for an inference tensor, which keeps none) and the writes declared by
    ``mark_updated``."""
    version = -1 if t.is_inference() else t._version
    return version, (_declared.get(id(t), 0) if _declared else 0)


def _tensors(value: Any, argument: str) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, MXTensor):
        yield value.data
        yield value.scale
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{argument}[{i}]")
    else:
        raise InvalidTypeError(argument, value, "a torch.Tensor, an MXTensor, or a list / tuple of them")
