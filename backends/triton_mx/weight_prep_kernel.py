"""Kernels that write the upcast weight layout (``layouts.UpcastWeight``) in one pass.

- ``quantize_upcast_kernel``: a high-precision (bf16 / fp16 / fp32) weight straight to
  the layout of E2M1 or E4M3 (``layouts_e4m3``: a byte per element, each block's eight
  bytes of a thread in two int32 words), quantizing each 32-block with the MX quantizer's
  own jit helpers (``grouped_gemm.mx.triton_kernels``: same scale rules, same rounding, so the
  result is bit-identical to ``quantize_mx_weight`` followed by the layout). Training
  re-quantizes the weights every step; this reads the weight once and writes 0.53 (E2M1)
  or 1.03 (E4M3) bytes per element, with no MXTensor in between and nothing read back to
  the host. (E4M3 never needs the prebuilt layout's NaN-block rule: a finite block
  saturates to ±448, never the NaN code, and a non-finite block gets scale byte 255 and
  zero codes, as in the quantizer.) One tile arrangement per contiguous axis of the
  input (its docstring says why).
- ``mx_upcast_kernel``: an E2M1 ``MXTensor`` (packed codes + scale bytes) to the layout,
  for all groups in one launch.

A program handles ``ROWS`` layout rows of one 128-element contraction run of one group.
Strides say where a row and a contraction element live in the input, so the same kernels
serve fwd (rows = N, contraction = K: contiguous along the contraction) and dgrad (rows =
K, contraction = N: contiguous along the rows). The word arrangement (element
``32b + 8j + 2q + h`` of a run -> word ``4q + b``, its code bits where
``decode.E2M1_BITS`` says) is in layouts.py; E4M3 words sit at
``layouts_e4m3.word_index`` instead.
"""

from __future__ import annotations

import triton
import triton.language as tl

from grouped_gemm.backends.triton_mx.decode import E2M1_BITS, rotate_left
from grouped_gemm.mx.triton_kernels import block_amax, block_scales, encode, widen

#: Words from an E4M3 low word of a run to its high word (``layouts_e4m3`` says why 16).
E4M3_HIGH_WORDS = tl.constexpr(16)


@triton.jit
def _words(codes, ROWS: tl.constexpr):
    """(ROWS, 128) E2M1 codes of a run -> (ROWS, 4 [b], 4 [q]) int32 words holding elements
    ``32b + 8j + 2q + h`` as pairs (j, h) (``_pack``)."""
    split = tl.reshape(codes, (ROWS, 4, 4, 4, 2))  # row, b, j, q, h
    return _pack(split, tl.arange(0, 4)[None, None, :, None, None], tl.arange(0, 2)[None, None, None, None, :], 2, 4, 4)


@triton.jit
def _store_run(data_ptr, scale_ptr, g, run, row, row_ok, words, scale_bytes, sd_g, sd_row, sd_run, ss_g, ss_run):
    """Store a run's words at word ``4q + b`` of each row and its four scale bytes as one
    little-endian int32 (byte b = 32-block b)."""
    b = tl.arange(0, 4)[None, :, None]
    q = tl.arange(0, 4)[None, None, :]
    base = data_ptr + g * sd_g + run * sd_run
    tl.store(base + row[:, None, None] * sd_row + 4 * q + b, words, mask=row_ok[:, None, None])
    packed = tl.sum(scale_bytes << (8 * tl.arange(0, 4)[None, :]), axis=1)
    tl.store(scale_ptr + g * ss_g + run * ss_run + row, packed, mask=row_ok)


@triton.jit
def _tile(runs, row_tiles, ROWS: tl.constexpr):
    """(group as int64, 128-run, first layout row) of this program."""
    pid = tl.program_id(0)
    g = (pid // (runs * row_tiles)).to(tl.int64)
    return g, pid % runs, ((pid // runs) % row_tiles) * ROWS


@triton.jit
def _load_threads_first(ptrs, mask, THREADED: tl.constexpr, BACK: tl.constexpr, FROM_FIRST: tl.constexpr):
    """``tl.load(ptrs, mask=mask, other=0)``, loaded as a tile whose axes ``THREADED`` come
    first among the non-contiguous ones when Triton hands threads out from the first axis
    (``FROM_FIRST``: Triton 3.6; 3.7 and later go from the last), then permuted back by
    ``BACK``: a renaming of registers, so the axes the caller lists first stay in registers
    with every Triton."""
    if FROM_FIRST:
        return tl.permute(tl.load(tl.permute(ptrs, THREADED), mask=tl.permute(mask, THREADED), other=0), BACK)
    return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def _pack(code, j, h, J_AXIS: tl.constexpr, H_AXIS: tl.constexpr, NBITS: tl.constexpr):
    """Words from codes whose axes ``J_AXIS`` / ``H_AXIS`` hold j and h (``j``, ``h``: their
    indices, broadcastable): E2M1 codes as nibble ``j + 4h`` of an int32, then moved to the
    stored arrangement (``_arrange_e2m1``), or E4M3 byte ``2j + h`` of an int64 whose low
    and high int32 halves ``_store_words`` puts apart (``layouts_e4m3``). The codes occupy
    disjoint bits, so the sum is their OR."""
    if NBITS == 8:
        words = tl.sum(tl.sum(code.to(tl.int64) << (16 * j + 8 * h).to(tl.int64), axis=H_AXIS), axis=J_AXIS)
    else:
        words = _arrange_e2m1(tl.sum(tl.sum(code << (4 * j + 16 * h), axis=H_AXIS), axis=J_AXIS))
    return words


@triton.jit
def _store_words(ptrs, words, mask, NBITS: tl.constexpr):
    """E2M1 int32 words at ``ptrs``; E4M3 int64 words as their low int32 half at ``ptrs``
    (``layout_word``) and their high half ``E4M3_HIGH_WORDS`` words on
    (``layouts_e4m3.word_index``)."""
    if NBITS == 8:
        tl.store(ptrs, words.to(tl.int32), mask=mask)
        tl.store(ptrs + E4M3_HIGH_WORDS, (words >> 32).to(tl.int32), mask=mask)
    else:
        tl.store(ptrs, words, mask=mask)


def _nibble_order_moves() -> list[tuple[int, int]]:
    """(rotation, mask) terms that take a word with element (j, h) at nibble ``j + 4h`` to
    the stored arrangement (``decode.E2M1_BITS``): every code bit that one left rotation
    puts in place, gathered per rotation. Six terms: each pair's magnitude and sign move
    apart, and pairs 2 and 3 share two rotations."""
    masks: dict[int, int] = {}
    for j, pair in enumerate(E2M1_BITS):
        for h, lane in enumerate(pair):
            for bit, place in enumerate(lane):
                rotation = (place - (4 * j + 16 * h + bit)) % 32
                masks[rotation] = masks.get(rotation, 0) | 1 << place
    return sorted(masks.items())


_MOVES = _nibble_order_moves()
_R0, _M0 = tl.constexpr(_MOVES[0][0]), tl.constexpr(_MOVES[0][1])
_R1, _M1 = tl.constexpr(_MOVES[1][0]), tl.constexpr(_MOVES[1][1])
_R2, _M2 = tl.constexpr(_MOVES[2][0]), tl.constexpr(_MOVES[2][1])
_R3, _M3 = tl.constexpr(_MOVES[3][0]), tl.constexpr(_MOVES[3][1])
_R4, _M4 = tl.constexpr(_MOVES[4][0]), tl.constexpr(_MOVES[4][1])
_R5, _M5 = tl.constexpr(_MOVES[5][0]), tl.constexpr(_MOVES[5][1])


@triton.jit
def _arrange_e2m1(words):
    """int32 words with element (j, h) at nibble ``j + 4h`` -> the stored arrangement that
    ``decode.e2m1_patterns`` undoes (``_nibble_order_moves``: six rotations and masks)."""
    u = words.to(tl.uint32, bitcast=True)
    out = (rotate_left(u, _R0) & _M0) | (rotate_left(u, _R1) & _M1) | (rotate_left(u, _R2) & _M2)
    out |= (rotate_left(u, _R3) & _M3) | (rotate_left(u, _R4) & _M4) | (rotate_left(u, _R5) & _M5)
    return out.to(tl.int32, bitcast=True)


@triton.jit
def layout_word(q, b):
    """The int32 word of a run holding position q of block b: ``4q + b`` (E2M1, layouts.py;
    E4M3's elements j = 0, 1, whose j = 2, 3 lie ``E4M3_HIGH_WORDS`` on:
    ``layouts_e4m3.word_index``). The upcast kernel reads the words by it too."""
    return 4 * q + b


@triton.jit
def _store_scales(scale_ptr, g, run, row0, rows, scale_bytes, ss_g, ss_run, ROWS: tl.constexpr):
    """The four (4, ROWS) scale bytes of each row's run as one little-endian int32 (byte b:
    32-block b)."""
    packed = tl.sum(scale_bytes << (8 * tl.arange(0, 4)[:, None]), axis=0)
    row = row0 + tl.arange(0, ROWS)
    tl.store(scale_ptr + g * ss_g + run * ss_run + row, packed, mask=row < rows)


@triton.jit
def quantize_upcast_kernel(
    w_ptr,
    data_ptr,
    scale_ptr,
    rows,
    k_red,
    runs,
    row_tiles,
    sw_g,
    sw_row,
    sw_k,
    sd_g,
    sd_row,
    sd_run,
    ss_g,
    ss_run,
    ROWS: tl.constexpr,
    RULE: tl.constexpr,
    EMAX: tl.constexpr,
    MAX_MANT: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_VALUE: tl.constexpr,
    NBITS: tl.constexpr,
    BF16_BITS: tl.constexpr,
    NATIVE: tl.constexpr,
    FROM_FIRST: tl.constexpr,
    ROWS_CONTIGUOUS: tl.constexpr,
):
    """One (group, ROWS-row tile, 128-run) of a weight quantized to E2M1 (``NBITS`` 4) or
    E4M3 (8) straight into the layout.

    Two tile arrangements, one result: ``ROWS_CONTIGUOUS`` (dgrad: the layout rows are K,
    contiguous) tiles (j, h, b, q, row), contraction element ``32b + 8j + 2q + h``; otherwise
    (fwd: the contraction is contiguous) (j, b, row, e), element ``32b + 8j + e`` with
    e = 2q + h a 16-byte vector. Either way a thread holds whole 32-blocks (j and h in its
    registers), so block maxima and word packing need no shuffles: sm_90 compiles under
    Triton 3.6, SASS per element, went from 23.8 to 16.8 (E2M1 along K), 23.0 to 13.0 (E4M3
    along K) and 23.6 to 20.4 with 56 instead of 205 registers (E2M1 along N) against one
    (rows, 128) tile for both; on the H200 the dsv3 gate-up weight's layouts take 0.66-0.95
    ms instead of 0.90-1.53 (docs/performance.md). Triton gives threads to the contiguous
    axis, then to the others, from the first one before 3.7 and from the last since:
    ``_load_threads_first`` loads in the order that keeps j and h in registers with either.
    ``layouts.quantize_upcast_weight`` picks the arrangement from the weight's strides."""
    g, run, row0 = _tile(runs, row_tiles, ROWS)
    if ROWS_CONTIGUOUS:
        j = tl.arange(0, 4)[:, None, None, None, None]
        h = tl.arange(0, 2)[None, :, None, None, None]
        b = tl.arange(0, 4)[None, None, :, None, None]
        q = tl.arange(0, 4)[None, None, None, :, None]
        row = row0 + tl.arange(0, ROWS)[None, None, None, None, :]
        c = run * 128 + 32 * b + 8 * j + 2 * q + h
        ptrs = w_ptr + g * sw_g + row.to(tl.int64) * sw_row + c.to(tl.int64) * sw_k
        mask = (row < rows) & (c < k_red)
        x = widen(_load_threads_first(ptrs, mask, (3, 2, 0, 1, 4), (2, 3, 1, 0, 4), FROM_FIRST), BF16_BITS)
        amax = tl.max(block_amax(x, 1, 0), axis=1)  # registers (j, h), then the threads of q
        inv_scale, nonfinite, scale_bytes = block_scales(amax, RULE, EMAX, MAX_MANT, MBITS)
        code = encode(x * inv_scale[None, None, :, None, :], MBITS, BIAS, MAX_VALUE, NBITS, NATIVE)
        code = tl.where(nonfinite[None, None, :, None, :], 0, code)
        words = _pack(code, j, h, 0, 1, NBITS)  # (b, q, row)
        row3 = row0 + tl.arange(0, ROWS)[None, None, :]
        offsets = row3 * sd_row + layout_word(tl.arange(0, 4)[None, :, None], tl.arange(0, 4)[:, None, None])
    else:
        j = tl.arange(0, 4)[:, None, None, None]
        b = tl.arange(0, 4)[None, :, None, None]
        row = row0 + tl.arange(0, ROWS)[None, None, :, None]
        c = run * 128 + 32 * b + 8 * j + tl.arange(0, 8)[None, None, None, :]
        ptrs = w_ptr + g * sw_g + row.to(tl.int64) * sw_row + c.to(tl.int64) * sw_k
        raw = _load_threads_first(ptrs, (row < rows) & (c < k_red), (1, 2, 0, 3), (2, 0, 1, 3), FROM_FIRST)
        x = widen(raw, BF16_BITS)
        inv_scale, nonfinite, scale_bytes = block_scales(block_amax(x, 3, 0), RULE, EMAX, MAX_MANT, MBITS)
        code = encode(x * inv_scale[None, :, :, None], MBITS, BIAS, MAX_VALUE, NBITS, NATIVE)
        code = tl.where(nonfinite[None, :, :, None], 0, code)
        jj = tl.arange(0, 4)[:, None, None, None, None]
        hh = tl.arange(0, 2)[None, None, None, None, :]
        words = _pack(tl.reshape(code, (4, 4, ROWS, 4, 2)), jj, hh, 0, 4, NBITS)  # (b, row, q)
        row3 = row0 + tl.arange(0, ROWS)[None, :, None]
        offsets = row3 * sd_row + layout_word(tl.arange(0, 4)[None, None, :], tl.arange(0, 4)[:, None, None])
    _store_words(data_ptr + g * sd_g + run * sd_run + offsets, words, row3 < rows, NBITS)
    _store_scales(scale_ptr, g, run, row0, rows, scale_bytes, ss_g, ss_run, ROWS)


@triton.jit
def mx_upcast_kernel(
    codes_ptr,
    mx_scale_ptr,
    data_ptr,
    scale_ptr,
    rows,
    k_red,
    runs,
    row_tiles,
    sc_g,
    sc_row,
    sc_pair,
    sm_g,
    sm_row,
    sm_block,
    sd_g,
    sd_row,
    sd_run,
    ss_g,
    ss_run,
    ROWS: tl.constexpr,
):
    g, run, row0 = _tile(runs, row_tiles, ROWS)
    row = row0 + tl.arange(0, ROWS)
    row_ok = row < rows
    c = run * 128 + tl.arange(0, 128)
    # Two codes per byte along the contraction: element c is nibble c % 2 of byte c // 2.
    ptrs = codes_ptr + g * sc_g + row[:, None].to(tl.int64) * sc_row + (c[None, :] // 2).to(tl.int64) * sc_pair
    packed = tl.load(ptrs, mask=row_ok[:, None] & (c < k_red)[None, :], other=0).to(tl.int32)
    codes = (packed >> (4 * (c[None, :] % 2))) & 15
    block = run * 4 + tl.arange(0, 4)
    s_ptrs = mx_scale_ptr + g * sm_g + row[:, None].to(tl.int64) * sm_row + block[None, :].to(tl.int64) * sm_block
    scale_bytes = tl.load(s_ptrs, mask=row_ok[:, None] & (block * 32 < k_red)[None, :], other=0).to(tl.int32)
    words = _words(codes, ROWS)
    _store_run(data_ptr, scale_ptr, g, run, row, row_ok, words, scale_bytes, sd_g, sd_row, sd_run, ss_g, ss_run)
