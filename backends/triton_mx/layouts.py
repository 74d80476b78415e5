"""The Hopper upcast kernel's weight layout, derived from an E2M1 ``MXTensor`` and cached.

``UpcastWeight`` holds, per group, the weight as ``rows x contraction`` (fwd: (N, K) from a
weight quantized along K; dgrad: (K, N) from one quantized along N), contraction padded to
a multiple of 128 with zero codes:

- ``data`` (G, rows, Kp/128, 16) int32, indexed (group, row, 128-run, word): words of
  eight E2M1 codes, arranged for Hopper's wgmma register operand. In the bf16 A fragment
  of ``m64nNk16``, the thread with ``q = lane % 4`` holds, per row, contraction elements
  2q, 2q+1, 2q+8, 2q+9 of each 16; so for every run of 128 elements a row stores 16
  words, word ``4q + b`` (q, b in 0..3) holding the elements ``32b + 8j + 2q + h`` of its
  32-block b (j in 0..3, h in 0..1). A thread's words are contiguous (16 bytes per 128
  elements), and every word lies in one 32-block (one scale). Within a word the pair j
  (the consecutive elements h = 0, 1 that share a register of the fragment, which the
  decode produces together) is stored so that rotating the word and masking gives its
  bf16 bit pattern (``decode.E2M1_PIECES``; ``decode.E2M1_BITS`` lists where each
  code bit sits): 9 integer instructions a word instead of the 15 of plain nibbles (``j + 4h``,
  the order ``weight_prep_kernel._pack`` starts from). The kernel puts the decoded values back
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
twice (``decode.e8m0_to_bf16x2``). Finding out reads the scales back to the host, so it
is only done for the cached layouts of pre-quantized ``MXTensor`` weights (which their
owner keeps fixed), outside CUDA-graph capture; weights quantized per call never do it.

Both ways of building a layout are one Triton launch over all groups
(``weight_prep_kernel``): ``quantize_upcast_weight`` quantizes a high-precision weight
straight into the layout, E2M1 or E4M3 (training: fresh weights every step), ``build_upcast_weight``
rearranges an E2M1 ``MXTensor``. ``upcast_weight`` caches the latter per ``MXTensor``
object (weakly keyed, invalidated when its tensors are modified in place, as torch counts
it or as ``gg.mark_updated`` declares it).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable

import torch
import triton

from grouped_gemm.backends.triton_mx import weight_prep_kernel
from grouped_gemm.mx import MXTensor, triton_quantizer
from grouped_gemm.mx.formats import FORMATS
from grouped_gemm.torch_device import capturing_on
from grouped_gemm.triton_launcher import CachedLauncher, cdiv
from grouped_gemm.updates import write_stamp

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
    #: Element format: "e2m1" (16 int32 words a run, built here) or "e4m3" (32: ``layouts_e4m3``).
    fmt: str = "e2m1"
    #: The strides the upcast kernel takes (data's first three, the scales' first two), read
    #: once per layout: a cached MXTensor's layout serves many launches (issue 14).
    strides: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "strides", (*self.data.stride()[:3], *self.scales.stride()[:2]))


def _empty_layout(
    groups: int, rows: int, k_red: int, device: torch.device, run_major: bool, fmt: str = "e2m1"
) -> UpcastWeight:
    """An unfilled layout of ``fmt`` (the kernels write every word and scale, padding included)."""
    k_padded = -(-k_red // K_ALIGN) * K_ALIGN
    runs = k_padded // K_ALIGN
    words = 32 if fmt == "e4m3" else 16
    if run_major:
        data = torch.empty(groups, runs, rows, words, dtype=torch.int32, device=device).transpose(1, 2)
    else:
        data = torch.empty(groups, rows, runs, words, dtype=torch.int32, device=device)
    scales = torch.empty(groups, runs, rows, dtype=torch.int32, device=device)
    return UpcastWeight(data=data, scales=scales, rows=rows, k_red=k_red, k_padded=k_padded, fmt=fmt)


#: Layout rows per program and warps of ``mx_upcast_kernel`` (an E2M1 MXTensor to the
#: layout), per op: what the quantize kernel's sweep chose on the H200 (2026-12-03, rows
#: 16-128 x warps 2-8), when the two kernels shared their tiles; never swept on its own.
MX_UPCAST_TILES = {"fwd": (32, 2), "dgrad": (64, 2)}
#: The same for the quantize-and-lay-out kernels, per (format, op): the fastest tile on all
#: six weight shapes of ``train_step.py --quick --prep-sweep`` (dsv3 gate-up, qwen3-30B
#: down, qwen3-235B gate-up, gpt-oss gate-up and down, mixtral down; rows 16-128 x warps
#: 2-8) on an H100 (Triton 3.6, 2026-12-06), except E4M3 dgrad, whose 32 x 2 led 64 x 4 by
#: at most 3 % (equal on mixtral). E4M3 fwd at 16 x 2 took 0.62-0.77x the time of the
#: earlier 64 x 4, chosen on the H200 before the E4M3 word order changed (dsv3 0.972
#: against 1.518 ms); E2M1 fwd at 32 x 2 0.93-0.98x of 128 x 4.
DEFAULT_TILES = {
    ("e2m1", "fwd"): (32, 2),
    ("e2m1", "dgrad"): (64, 4),
    ("e4m3", "fwd"): (16, 2),
    ("e4m3", "dgrad"): (32, 2),
}

#: Triton before 3.7 hands a tile's threads to its non-contiguous axes from the first, later
#: releases from the last (seen in sm_90 compiles of the prep kernels under 3.6.0, 3.7.1 and
#: 3.9.0); the prep kernels load in the order that keeps their register axes in registers.
THREADS_FROM_FIRST_AXIS = tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 7)

_MX_UPCAST = CachedLauncher(weight_prep_kernel.mx_upcast_kernel)
_QUANTIZE_UPCAST = CachedLauncher(weight_prep_kernel.quantize_upcast_kernel)


def _grid_and_strides(lay: UpcastWeight, groups: int, rows: int) -> tuple[tuple[int], int, tuple[int, ...]]:
    """Grid (one program per group, tile of ``rows`` layout rows and 128-run), row tiles,
    layout strides."""
    runs = lay.k_padded // K_ALIGN
    row_tiles = cdiv(lay.rows, rows)
    strides = (lay.data.stride(0), lay.data.stride(1), lay.data.stride(2), lay.scales.stride(0), lay.scales.stride(1))
    return (groups * row_tiles * runs,), row_tiles, strides


def build_upcast_weight(mx: MXTensor, check_scales: bool = False, run_major: bool = True) -> UpcastWeight:
    """The upcast layout of a (G, N, K) E2M1 weight quantized along K (fwd) or N (dgrad);
    ``check_scales`` finds out ``small_scales`` (one device-to-host read); ``run_major``
    False stores rows contiguously instead (the same logical layout, for comparisons)."""
    groups = mx.shape[0]
    fwd = mx.axis == 2
    rows = mx.shape[1] if fwd else mx.shape[2]
    lay = _empty_layout(groups, rows, mx.shape[mx.axis], mx.device, run_major)
    if lay.data.numel():
        rows_per, warps = MX_UPCAST_TILES["fwd" if fwd else "dgrad"]
        grid, row_tiles, strides = _grid_and_strides(lay, groups, rows_per)
        codes, scale = mx.data, mx.scale
        # (row, contraction) strides of the packed codes and of the scale bytes.
        code_strides = (codes.stride(1), codes.stride(2)) if fwd else (codes.stride(2), codes.stride(1))
        scale_strides = (scale.stride(1), scale.stride(2)) if fwd else (scale.stride(2), scale.stride(1))
        _MX_UPCAST(
            grid,
            codes,
            scale,
            lay.data,
            lay.scales,
            rows,
            lay.k_red,
            lay.k_padded // K_ALIGN,
            row_tiles,
            codes.stride(0),
            *code_strides,
            scale.stride(0),
            *scale_strides,
            *strides,
            ROWS=rows_per,
            num_warps=warps,
        )
    small = check_scales and not capturing_on(mx.device) and bool((mx.scale <= 128).all())
    return dataclasses.replace(lay, small_scales=small)


def quantize_upcast_weight(
    w: torch.Tensor,
    op: str,
    scale_rule: str,
    run_major: bool = True,
    *,
    fmt: str = "e2m1",
    tile: tuple[int, int] | None = None,
) -> UpcastWeight:
    """A (G, N, K) bf16 / fp16 / fp32 weight quantized to ``fmt`` (E2M1 or E4M3) for ``op``
    (fwd: blocks along K; dgrad: along N) and laid out, in one pass; bit-identical to
    building the layout (``build_upcast_weight`` / ``layouts_e4m3.build_upcast_weight_e4m3``)
    from ``quantize_mx_weight(w, fmt, op=op, scale_rule=scale_rule)``. The contraction must
    be a multiple of 32 (the backend's ``k_multiple`` / ``n_multiple``). ``tile`` (layout
    rows per program, a power of two; warps) overrides ``DEFAULT_TILES`` (benchmarks)."""
    groups, n, k = w.shape
    fwd = op == "fwd"
    lay = _empty_layout(groups, n if fwd else k, k if fwd else n, w.device, run_major, fmt)
    if lay.data.numel():
        x = w.view(torch.int16) if w.dtype == torch.bfloat16 else w
        rows_per, warps = tile or DEFAULT_TILES[fmt, op]
        grid, row_tiles, strides = _grid_and_strides(lay, groups, rows_per)
        weight_strides = (x.stride(1), x.stride(2)) if fwd else (x.stride(2), x.stride(1))
        # The same layout either way; the tile arrangement that follows the contiguous axis is faster.
        rows_contiguous = weight_strides[0] == 1 and weight_strides[1] != 1
        _QUANTIZE_UPCAST(
            grid,
            x,
            lay.data,
            lay.scales,
            lay.rows,
            lay.k_red,
            lay.k_padded // K_ALIGN,
            row_tiles,
            x.stride(0),
            *weight_strides,
            *strides,
            ROWS=rows_per,
            FROM_FIRST=THREADS_FROM_FIRST_AXIS,
            ROWS_CONTIGUOUS=rows_contiguous,
            num_warps=warps,
            **prep_format_args(x, fmt, scale_rule, rows_contiguous),
        )
    return lay


def prep_format_args(x: torch.Tensor, fmt: str, scale_rule: str, strided: bool) -> dict[str, int]:
    """The quantizer's own constants (same rules, same rounding). The strided kernel rounds
    E4M3 with integer ops instead of the hardware fp8 conversion: under Triton 3.6 on the
    H200 that conversion came out wrong there (byte 5 of every word 0xFC, 2026-12-04), and
    the integer rounding is bit-identical by construction (``triton_kernels.encode``)."""
    args = triton_quantizer.format_args(x, FORMATS[fmt], scale_rule)
    return {**args, "NATIVE": False} if strided else args


_cache: weakref.WeakKeyDictionary[MXTensor, tuple[tuple[tuple[int, int], ...], UpcastWeight]] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.Lock()


def upcast_weight(mx: MXTensor, build: Callable[..., UpcastWeight] | None = None) -> UpcastWeight:
    """``build(mx, check_scales=True)`` (default ``build_upcast_weight``), computed once per
    MXTensor object and write stamp of its tensors (``gg.mark_updated`` counts the writes
    torch does not)."""
    version = (write_stamp(mx.data), write_stamp(mx.scale))
    with _lock:
        hit = _cache.get(mx)
    if hit is not None and hit[0] == version:
        return hit[1]
    layout = (build or build_upcast_weight)(mx, check_scales=True)
    with _lock:
        _cache[mx] = (version, layout)
    return layout
