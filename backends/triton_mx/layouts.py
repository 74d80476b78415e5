"""The Hopper upcast kernel's weight layout, derived from an E2M1 ``MXTensor`` and cached.

``UpcastWeight`` holds, per group, the weight as ``rows x contraction`` (fwd: (N, K) from a
weight quantized along K; dgrad: (K, N) from one quantized along N), contraction padded to
a multiple of 128 with zero codes:

- ``data`` (G, rows, Kp/128, 16) int32, indexed (group, row, 128-run, word): words of
  eight E2M1 codes, arranged for Hopper's wgmma register operand. In the bf16 A fragment
  of ``m64nNk16``, the thread with ``q = lane % 4`` holds, per row, contraction elements
  2q, 2q+1, 2q+8, 2q+9 of each 16; so for every run of 128 elements a row stores 16
  words, word ``4q + b`` (q, b in 0..3) holding the elements ``32b + 8j + 2q + h`` of its
  32-block b at nibble ``j + 4h`` (j in 0..3, h in 0..1). A thread's words are contiguous
  (16 bytes per 128 elements), every word lies in one 32-block (one scale), and nibbles
  i and i + 4 are the consecutive elements (k, k+1) that share a register of the
  fragment, which the decode produces together. The kernel puts the decoded values back
  in contraction order with join / permute / reshape, which the compiler resolves to
  register renaming (no data movement: docs/notes/triton_mxfp4.md has the instruction
  counts). Stored run-major (memory order group, run, row, word): the runs a row tile
  reads in one contraction step are one contiguous ``rows x 64``-byte stretch, and long
  contiguous reads are what HBM serves fastest when a decode-like call streams the
  weight once (docs/notes/triton_mxfp4.md compares the row-major order).
- ``scales`` (G, Kp/128, rows) int32: the four E8M0 bytes of each 128-element run of a
  row, little-endian, transposed so a row tile's scales are one contiguous 4-byte-per-row
  load (the software pipeliner only streams loads of at least 4 bytes per thread).

``small_scales`` records whether every scale byte is at most 128 (|w| < 12 everywhere);
then the kernel folds the decode's 2^126 into the scale and multiplies once instead of
twice (``decode.e8m0_to_bf16x2``). Finding out reads the scales back to the host once, so
it is only done for cached layouts outside CUDA-graph capture.

Building it costs a few passes over the weight; ``upcast_weight`` caches the result per
``MXTensor`` object (weakly keyed, invalidated when its tensors are modified in place), so
inference with fixed quantized weights pays it once.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable

import torch

from grouped_gemm.mx import MXTensor

#: Contraction padding of the layout (one int32 of scales covers 128 elements).
K_ALIGN = 128


@dataclasses.dataclass(frozen=True)
class UpcastWeight:
    """A weight in the upcast kernel's layout (see the module docstring)."""

    data: torch.Tensor
    scales: torch.Tensor
    rows: int
    k_red: int
    k_padded: int
    small_scales: bool = False
    #: Element format: "e2m1" (int32 words, built here) or "e4m3" (int64 words: ``layouts_e4m3``).
    fmt: str = "e2m1"


def _codes_rows_by_contraction(mx: MXTensor, g: int) -> torch.Tensor:
    """Group ``g``'s E2M1 codes as (rows, contraction) uint8, one code per byte."""
    d = mx.data[g]
    if mx.axis == 2:
        return torch.stack((d & 15, d >> 4), dim=-1).reshape(d.shape[0], -1)
    codes = torch.stack((d & 15, d >> 4), dim=1).reshape(-1, d.shape[1])
    return codes.T


def _scales_rows_by_blocks(mx: MXTensor, g: int) -> torch.Tensor:
    """Group ``g``'s scale bytes as (rows, contraction / 32)."""
    s = mx.scale[g]
    return s if mx.axis == 2 else s.T


def build_upcast_weight(mx: MXTensor, check_scales: bool = False, run_major: bool = True) -> UpcastWeight:
    """The upcast layout of a (G, N, K) E2M1 weight quantized along K (fwd) or N (dgrad);
    ``check_scales`` finds out ``small_scales`` (one device-to-host read); ``run_major``
    False stores rows contiguously instead (the same logical layout, for comparisons)."""
    groups = mx.shape[0]
    rows = mx.shape[1] if mx.axis == 2 else mx.shape[2]
    k_red = mx.shape[mx.axis]
    k_padded = -(-k_red // K_ALIGN) * K_ALIGN
    runs = k_padded // K_ALIGN
    if run_major:
        data = torch.empty(groups, runs, rows, 16, dtype=torch.int32, device=mx.device).transpose(1, 2)
    else:
        data = torch.empty(groups, rows, runs, 16, dtype=torch.int32, device=mx.device)
    scales = torch.empty(groups, k_padded // K_ALIGN, rows, dtype=torch.int32, device=mx.device)
    for g in range(groups):
        codes = torch.nn.functional.pad(_codes_rows_by_contraction(mx, g), (0, k_padded - k_red)).to(torch.int64)
        # Element 32b + 8j + 2q + h of each 128-run -> word 4q + b, nibble j + 4h.
        split = codes.reshape(rows, runs, 4, 4, 4, 2)  # row, run, b, j, q, h
        nibbles = split.permute(0, 1, 4, 2, 5, 3).reshape(rows, k_padded // 8, 8)  # row, word (q, b), nibble (h, j)
        words = (nibbles << (4 * torch.arange(8, device=codes.device))).sum(-1)
        data[g] = (words - ((words >> 31) << 32)).to(torch.int32).reshape(rows, runs, 16)
        blocks = torch.nn.functional.pad(_scales_rows_by_blocks(mx, g), (0, (k_padded - k_red) // 32))
        scales[g] = blocks.contiguous().view(torch.int32).T
    small = check_scales and not _capturing(mx.device) and bool((mx.scale <= 128).all())
    return UpcastWeight(data=data, scales=scales, rows=rows, k_red=k_red, k_padded=k_padded, small_scales=small)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


_cache: weakref.WeakKeyDictionary[MXTensor, tuple[tuple[int, int], UpcastWeight]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def upcast_weight(mx: MXTensor, build: Callable[..., UpcastWeight] | None = None) -> UpcastWeight:
    """``build(mx, check_scales=True)`` (default ``build_upcast_weight``), computed once per
    MXTensor object and tensor version."""
    version = (mx.data._version, mx.scale._version)
    with _lock:
        hit = _cache.get(mx)
    if hit is not None and hit[0] == version:
        return hit[1]
    layout = (build or build_upcast_weight)(mx, check_scales=True)
    with _lock:
        _cache[mx] = (version, layout)
    return layout
