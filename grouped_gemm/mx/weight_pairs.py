"""A weight quantized for the forward and for dgrad from one read, within one training step.

An MX training step quantizes each master weight twice: along K in the forward GEMM and
along N in dgrad (``quantize_mx_weight``), each pass reading the whole high-precision
weight. When the forward knows that dgrad will follow, one pass can write both copies
(``quantize_mx_weight_pair``): for bf16 weights and 8-bit formats it moves 4 bytes an
element instead of 6. ``GroupedLinearFunction`` opens a ``WeightPairs`` around its forward
and its backward; a backend that quantizes plain MX weights itself calls ``quantize_weight``,
which in such a forward quantizes both ways and keeps the dgrad copy for that call's
backward (handed over once, then dropped). Only where one read serves both (8-bit formats
on a GPU); E2M1 weights and CPU tensors are quantized per op as before. The cost is that copy's memory, one byte an
element plus scales, held from forward to backward. Outside a ``WeightPairs`` (inference,
functional calls, ``torch.compile``'s custom ops) ``quantize_weight`` is
``quantize_mx_weight``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

from grouped_gemm.mx.formats import BLOCK_SIZE
from grouped_gemm.mx.grouped import pairs_in_one_read, quantize_mx_weight, quantize_mx_weight_pair
from grouped_gemm.mx.tensor import MXTensor
from grouped_gemm.updates import write_stamp


class WeightPairs:
    """The dgrad operands a forward made, by ``weight_key``: an MXTensor blocked along N
    (``quantize_weight``), or a backend's own layout of it (the Triton upcast layout)."""

    def __init__(self) -> None:
        self._dgrad: dict[tuple, Any] = {}

    def __len__(self) -> int:
        return len(self._dgrad)

    def put(self, key: tuple, dgrad_operand: Any) -> None:
        self._dgrad[key] = dgrad_operand

    def take(self, key: tuple) -> Any:
        """The operand kept under ``key`` (then no longer kept), or None."""
        return self._dgrad.pop(key, None)


_ACTIVE: contextvars.ContextVar[WeightPairs | None] = contextvars.ContextVar("grouped_gemm_weight_pairs", default=None)


@contextlib.contextmanager
def pairing(pairs: WeightPairs | None) -> Iterator[None]:
    """Make ``pairs`` the store ``quantize_weight`` fills (a forward) or reads (a backward);
    None turns pairing off inside the block."""
    token = _ACTIVE.set(pairs)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> WeightPairs | None:
    """The store of the forward or backward running now (``pairing``), if any."""
    return _ACTIVE.get()


def weight_key(w: torch.Tensor, *how: Any) -> tuple:
    """This very weight as it is now (storage, layout, write stamp), and ``how`` it is
    quantized: equal keys in forward and backward mean the kept operand is the one
    backward would make."""
    return (w.data_ptr(), w.device, w.dtype, tuple(w.shape), w.stride(), write_stamp(w), *how)


def quantize_weight(
    w: torch.Tensor,
    fmt: str,
    *,
    op: str,
    scale_rule: str = "rceil",
    block_size: int = BLOCK_SIZE,
    pad: bool = False,
) -> MXTensor:
    """``quantize_mx_weight(w, fmt, op=op, ...)``, pairing-aware: inside a forward's
    ``WeightPairs`` an ``op="fwd"`` call also makes the dgrad copy and keeps it; inside the
    backward, ``op="dgrad"`` takes that copy if it is of this very weight (same storage,
    layout and write stamp) and these arguments."""
    pairs = _ACTIVE.get()
    if (
        pairs is None
        or not isinstance(w, torch.Tensor)
        or w.dim() != 3
        or op not in ("fwd", "dgrad")
        or not pairs_in_one_read(w, fmt)  # nothing saved: each op quantizes its own, as usual
    ):
        return quantize_mx_weight(w, fmt, op=op, scale_rule=scale_rule, block_size=block_size, pad=pad)
    key = weight_key(w, "mx", fmt, scale_rule, block_size, pad)
    if op == "dgrad":
        kept = pairs.take(key)
        if kept is not None:
            return kept
        return quantize_mx_weight(w, fmt, op=op, scale_rule=scale_rule, block_size=block_size, pad=pad)
    along_k, along_n = quantize_mx_weight_pair(w, fmt, scale_rule=scale_rule, block_size=block_size, pad=pad)
    pairs.put(key, along_n)
    return along_k
