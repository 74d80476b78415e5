"""Kernels that write the upcast weight layout (``layouts.UpcastWeight``) in one pass.

- ``quantize_upcast_kernel``: a high-precision (bf16 / fp16 / fp32) weight straight to the
  layout of E2M1 or E4M3 (``layouts_e4m3``: a byte per element, int64 words), quantizing
  each 32-block with the MX quantizer's own jit helpers
  (``grouped_gemm.mx.triton_kernels``: same scale rules, same rounding, so the result is
  bit-identical to ``quantize_mx_weight`` followed by the layout). Training re-quantizes
  the weights every step; this reads the weight once and writes 0.53 bytes per element,
  with no MXTensor in between and nothing read back to the host. (E4M3 never needs the
  prebuilt layout's NaN-block rule: a finite block saturates to ±448, never the NaN code,
  and a non-finite block gets scale byte 255 and zero codes, as in the quantizer.)
- ``mx_upcast_kernel``: an E2M1 ``MXTensor`` (packed codes + scale bytes) to the layout,
  for all groups in one launch.

A program handles ``ROWS`` layout rows of one 128-element contraction run of one group.
Strides say where a row and a contraction element live in the input, so the same kernels
serve fwd (rows = N, contraction = K: contiguous along the contraction) and dgrad (rows =
K, contraction = N: contiguous along the rows). The word arrangement (element
``32b + 8j + 2q + h`` of a run -> word ``4q + b``, nibble ``j + 4h``) is in layouts.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from grouped_gemm.mx.triton_kernels import block_amax, encode, scale_exponent, widen


@triton.jit
def _words(codes, ROWS: tl.constexpr, BYTE_CODES: tl.constexpr):
    """(ROWS, 128) codes of a run -> (ROWS, 4 [b], 4 [q]) words: E2M1 (int32, element
    ``32b + 8j + 2q + h`` at nibble ``j + 4h``) or, with ``BYTE_CODES``, E4M3 (int64, at byte
    ``2j + h``: ``layouts_e4m3``). The codes occupy disjoint bits, so their sum is their
    bitwise OR (and never overflows)."""
    split = tl.reshape(codes, (ROWS, 4, 4, 4, 2))  # row, b, j, q, h
    j = tl.arange(0, 4)[None, None, :, None, None]
    h = tl.arange(0, 2)[None, None, None, None, :]
    if BYTE_CODES:
        shifted = split.to(tl.int64) << (16 * j + 8 * h).to(tl.int64)
    else:
        shifted = split << (4 * j + 16 * h)
    return tl.sum(tl.sum(shifted, axis=4), axis=2)


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
):
    """One (group, ROWS-row tile, 128-run) of a weight quantized to E2M1 (``NBITS`` 4) or
    E4M3 (8) straight into the layout of that format."""
    pid = tl.program_id(0)
    run = pid % runs
    row_tile = (pid // runs) % row_tiles
    g = (pid // (runs * row_tiles)).to(tl.int64)
    row = row_tile * ROWS + tl.arange(0, ROWS)
    row_ok = row < rows
    c = run * 128 + tl.arange(0, 128)
    ptrs = w_ptr + g * sw_g + row[:, None].to(tl.int64) * sw_row + c[None, :].to(tl.int64) * sw_k
    raw = tl.load(ptrs, mask=row_ok[:, None] & (c < k_red)[None, :], other=0)
    x = tl.reshape(widen(raw, BF16_BITS), (ROWS, 4, 32))
    # The quantizer's steps (quantize_last): amax bits -> E8M0 exponent -> power-of-two
    # reciprocal -> nearest-even codes; a block holding NaN / Inf gets byte 255, codes 0.
    # Blocks past k_red read zeros: scale byte 0 and zero codes, the layout's padding.
    amax = block_amax(x, 2, -1)
    exp = scale_exponent(amax, RULE, EMAX, MAX_MANT, MBITS)
    nonfinite = amax >= 0x7F800000
    inv_scale = ((127 - exp) << 23).to(tl.float32, bitcast=True)
    code = encode(x * inv_scale[:, :, None], MBITS, BIAS, MAX_VALUE, NBITS, NATIVE)
    code = tl.where(nonfinite[:, :, None], 0, code)
    words = _words(tl.reshape(code, (ROWS, 128)), ROWS, NBITS == 8)
    scale_bytes = tl.where(nonfinite, 255, exp + 127)
    _store_run(data_ptr, scale_ptr, g, run, row, row_ok, words, scale_bytes, sd_g, sd_row, sd_run, ss_g, ss_run)


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
    pid = tl.program_id(0)
    run = pid % runs
    row_tile = (pid // runs) % row_tiles
    g = (pid // (runs * row_tiles)).to(tl.int64)
    row = row_tile * ROWS + tl.arange(0, ROWS)
    row_ok = row < rows
    c = run * 128 + tl.arange(0, 128)
    # Two codes per byte along the contraction: element c is nibble c % 2 of byte c // 2.
    ptrs = codes_ptr + g * sc_g + row[:, None].to(tl.int64) * sc_row + (c[None, :] // 2).to(tl.int64) * sc_pair
    packed = tl.load(ptrs, mask=row_ok[:, None] & (c < k_red)[None, :], other=0).to(tl.int32)
    codes = (packed >> (4 * (c[None, :] % 2))) & 15
    block = run * 4 + tl.arange(0, 4)
    s_ptrs = mx_scale_ptr + g * sm_g + row[:, None].to(tl.int64) * sm_row + block[None, :].to(tl.int64) * sm_block
    scale_bytes = tl.load(s_ptrs, mask=row_ok[:, None] & (block * 32 < k_red)[None, :], other=0).to(tl.int32)
    words = _words(codes, ROWS, False)
    _store_run(data_ptr, scale_ptr, g, run, row, row_ok, words, scale_bytes, sd_g, sd_row, sd_run, ss_g, ss_run)
