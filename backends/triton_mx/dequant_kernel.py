"""MX -> bf16 decode of an activation or gradient operand (the Hopper path's first pass).

Three kernels: ``dequant_kernel`` decodes an ``MXTensor``; ``quantize_decode_kernel`` takes a
high-precision activation, quantizes each 32-block along its last axis with the MX
quantizer's own jit helpers and writes the decoded values, in one pass: the same bf16
tensor as quantizing (``gg.quantize_mx``) and then decoding, without writing and reading
the codes in between. ``quantize_decode_rows_kernel`` does the same along the tokens per
group for wgrad (the blocks of ``gg.quantize_mx_rows``: every group's rows from its own
start, its last block zero-padded), storing each decoded row in its own place, so the
result is as tight as the input and the padding rows are never written.

Hopper's wgmma reads its right operand from shared memory, so an activation upcast inside
the GEMM would make the trip through shared memory that the weights avoid. Instead the
Hopper path decodes MX activations once, exactly, to bf16 (E4M3 and E2M1 values times
powers of two are bf16 numbers), then runs the bf16 x E2M1 kernel: one extra pass over
the activations, a few percent of a compute-bound GEMM. The result is bit-identical to
``MXTensor.dequantize(torch.bfloat16)`` (NaNs are NaN, their payloads unspecified).

The pass is memory-bound (1 or 0.5 bytes read and 2 written per element), so the kernel is
shaped around wide accesses without layout conversions: every tile is (rows, vectors, 8),
eight consecutive elements per thread being one 16-byte bf16 store. Codes are loaded in
that same layout as stored (8-byte E4M3 / 4-byte E2M1 loads, so no shared-memory shuffle
between load and store); E2M1 nibbles are split once and interleaved in registers
(``tl.join`` + ``reshape``; along axis 0 they are even and odd rows). Each vector loads its
scale byte(s) directly (L1 hits: one 32-block spans 4 vectors), not through a gather tile.
- E5M2 is the top byte of an fp16 (one shift and a widening conversion, exact).
- E4M3 uses the hardware conversion (``HW_E4M3``, sm_89+: exact, 0x7F / 0xFF to NaN);
  the portable integer decode of ``decode.py`` serves the interpreter and other targets.
- The value times its scale is computed in fp32 and rounded once to bf16, as
  ``MXTensor.dequantize`` does; the fp32 product is exact, so the result is too (or
  infinite, where the true value exceeds the bf16 range).
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from grouped_gemm.backends.triton_mx.decode import e2m1_to_fp32, e4m3_to_fp32, e5m2_to_fp32, e8m0_to_fp32, narrow
from grouped_gemm.mx.triton_kernels import block_amax, block_scales, encode, group_rows, widen


@triton.jit
def _vectors(start, N: tl.constexpr, V: tl.constexpr):
    """Indices start .. start + N - 1 as (N / V, V) runs of ``V`` consecutive ones."""
    return start + (tl.arange(0, N // V) * V)[:, None] + tl.arange(0, V)[None, :]


@triton.jit
def _decode(codes, FMT: tl.constexpr, HW_E4M3: tl.constexpr):
    """Element codes (E2M1 nibbles, E4M3 or E5M2 bytes, uint8) -> fp32 values (exact)."""
    if FMT == "e2m1":
        return e2m1_to_fp32(codes)
    if FMT == "e5m2":
        return e5m2_to_fp32(codes)
    if HW_E4M3:
        return codes.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return e4m3_to_fp32(codes)


@triton.jit
def quantized_values(
    x,
    AXIS: tl.constexpr,
    FMT: tl.constexpr,
    HW_E4M3: tl.constexpr,
    RULE: tl.constexpr,
    EMAX: tl.constexpr,
    MAX_MANT: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_VALUE: tl.constexpr,
    NBITS: tl.constexpr,
    NATIVE: tl.constexpr,
):
    """fp32 ``x`` whose axis ``AXIS`` is one 32-block -> each block quantized to ``FMT``
    with the MX quantizer's own helpers and decoded, ``decode(code) * 2^exp`` in fp32 (exact):
    the values ``gg.quantize_mx`` then ``MXTensor.dequantize`` give, before the one rounding
    to the result's dtype. Written once for the quantize-and-decode passes and the upcast
    kernel's fused activations."""
    inv_scale, _, scale_bytes = block_scales(block_amax(x, AXIS, -1), RULE, EMAX, MAX_MANT, MBITS)
    code = encode(x * tl.expand_dims(inv_scale, AXIS), MBITS, BIAS, MAX_VALUE, NBITS, NATIVE)
    return _decode(code, FMT, HW_E4M3) * tl.expand_dims(e8m0_to_fp32(scale_bytes), AXIS)


@triton.jit
def dequant_kernel(
    D,
    stride_d,
    S,
    stride_s,
    Out,
    stride_o,
    rows,
    cols,
    col_tiles,
    AXIS: tl.constexpr,
    FMT: tl.constexpr,
    HW_E4M3: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    INTERP: tl.constexpr,
):
    """Decode the (BR, BC) tile of a 2-D MX tensor blocked along ``AXIS`` (E2M1 packed
    along it) into ``Out`` (rows x cols, the logical shape). Along ``AXIS`` the tile spans
    whole 32-blocks (BR or BC a multiple of 32), and loads are masked by block, so they
    stay 16 bytes wide at any length; padding past the logical shape is read, not stored.
    Programs run row tile by row tile (column tiles fastest), so the programs in flight
    read and write a few whole rows: contiguous stretches of memory, not a column stripe
    across thousands of rows (20-40 % faster on the H200 at the same tiles)."""
    V: tl.constexpr = 8  # elements per vector: a 16-byte bf16 store
    PER_BYTE: tl.constexpr = 2 if FMT == "e2m1" else 1
    row_tile = tl.program_id(0) // col_tiles
    col_tile = tl.program_id(0) % col_tiles
    r = row_tile * BR + tl.arange(0, BR)
    r64 = r.to(tl.int64)[:, None, None]
    cv = _vectors(col_tile * BC, BC, V)
    if AXIS == 1:
        # (BR, BC / V, V / PER_BYTE): whole 32-blocks are in the tensor or not.
        bv = _vectors(col_tile * (BC // PER_BYTE), BC // PER_BYTE, V // PER_BYTE)
        live = (r < rows)[:, None, None] & (bv < tl.cdiv(cols, 32) * (32 // PER_BYTE))[None, :, :]
        codes = tl.load(D + r64 * stride_d + bv[None, :, :], mask=live, other=0)
        if FMT == "e2m1":  # element 2i in the low nibble of byte i
            codes = tl.reshape(tl.join(codes & 15, codes >> 4), (BR, BC // V, V))
        sv = cv // 32
        in_s = (r < rows)[:, None, None] & (sv < tl.cdiv(cols, 32))[None, :, :]
        scale = tl.load(S + r64 * stride_s + sv[None, :, :], mask=in_s, other=0)
    else:
        rb = row_tile * (BR // PER_BYTE) + tl.arange(0, BR // PER_BYTE)
        # (BR / PER_BYTE, BC / V, V) bytes: whole 32-blocks are in the tensor or not.
        live = (rb < tl.cdiv(rows, 32) * (32 // PER_BYTE))[:, None, None] & (cv < cols)[None, :, :]
        codes = tl.load(D + rb.to(tl.int64)[:, None, None] * stride_d + cv[None, :, :], mask=live, other=0)
        if FMT == "e2m1":  # row 2i in the low nibble of byte row i
            codes = tl.join(codes & 15, codes >> 4)
            codes = tl.reshape(tl.permute(codes, (0, 3, 1, 2)), (BR, BC // V, V))
        rs = (r // 32).to(tl.int64)[:, None, None]
        in_s = (r < tl.cdiv(rows, 32) * 32)[:, None, None] & (cv < cols)[None, :, :]
        scale = tl.load(S + rs * stride_s + cv[None, :, :], mask=in_s, other=0)
    values = _decode(codes, FMT, HW_E4M3) * e8m0_to_fp32(scale)
    ok = (r < rows)[:, None, None] & (cv < cols)[None, :, :]
    out = Out + r64 * stride_o + cv[None, :, :]
    tl.store(out, narrow(values, Out.dtype.element_ty, INTERP), mask=ok)


@triton.jit
def quantize_decode_kernel(
    X,
    stride_x,
    Out,
    stride_o,
    rows,
    cols,
    col_tiles,
    FMT: tl.constexpr,
    HW_E4M3: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    RULE: tl.constexpr,
    EMAX: tl.constexpr,
    MAX_MANT: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_VALUE: tl.constexpr,
    NBITS: tl.constexpr,
    BF16_BITS: tl.constexpr,
    NATIVE: tl.constexpr,
    INTERP: tl.constexpr,
):
    """The (BR, BC) tile of a 2-D high-precision tensor, quantized per 32-block of its last
    axis (``BC`` a multiple of 32; columns past ``cols`` read as zeros, as the quantizer
    pads) and decoded: ``decode(code) * 2^exp`` in fp32, rounded once to ``Out``'s dtype, as
    ``MXTensor.dequantize`` computes it. A block holding NaN or Inf decodes to NaN (the
    quantizer gives it scale byte 255)."""
    row_tile = tl.program_id(0) // col_tiles
    col_tile = tl.program_id(0) % col_tiles
    r = row_tile * BR + tl.arange(0, BR)
    r64 = r.to(tl.int64)[:, None, None]
    blk = col_tile * (BC // 32) + tl.arange(0, BC // 32)
    c = blk[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    row_ok = (r < rows)[:, None, None]
    x = widen(tl.load(X + r64 * stride_x + c, mask=row_ok & (c < cols), other=0), BF16_BITS)
    values = quantized_values(x, 2, FMT, HW_E4M3, RULE, EMAX, MAX_MANT, MBITS, BIAS, MAX_VALUE, NBITS, NATIVE)
    tl.store(Out + r64 * stride_o + c, narrow(values, Out.dtype.element_ty, INTERP), mask=row_ok & (c < cols))


@triton.jit
def quantize_decode_rows_kernel(
    X,
    stride_x,
    Out,
    stride_o,
    starts,
    padded_starts,
    groups,
    rows,
    cols,
    col_tiles,
    SEARCH_STEPS: tl.constexpr,
    FMT: tl.constexpr,
    HW_E4M3: tl.constexpr,
    BC: tl.constexpr,
    RULE: tl.constexpr,
    EMAX: tl.constexpr,
    MAX_MANT: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_VALUE: tl.constexpr,
    NBITS: tl.constexpr,
    BF16_BITS: tl.constexpr,
    NATIVE: tl.constexpr,
    INTERP: tl.constexpr,
):
    """Padded 32-row block ``program_id // col_tiles`` of the per-group token layout
    (``starts`` / ``padded_starts``: (groups + 1,) int32) by ``BC`` columns: its group's
    rows, zeros past the group's end, quantized along the rows and decoded as
    ``quantize_decode_kernel`` does along columns; each real row is stored at its own row
    of ``Out`` (the input's shape). A block past the last group stores nothing."""
    block = tl.program_id(0) // col_tiles
    col_tile = tl.program_id(0) % col_tiles
    shift, limit = group_rows(starts, padded_starts, groups, block * 32, SEARCH_STEPS)
    p = block * 32 + tl.arange(0, 32)
    src = p.to(tl.int64) + shift
    c = (col_tile * BC + tl.arange(0, BC))[None, :]
    ok = ((p < limit) & (src >= 0) & (src < rows))[:, None] & (c < cols)  # bad device splits: no access
    src = src[:, None]
    x = widen(tl.load(X + src * stride_x + c, mask=ok, other=0), BF16_BITS)
    values = quantized_values(x, 0, FMT, HW_E4M3, RULE, EMAX, MAX_MANT, MBITS, BIAS, MAX_VALUE, NBITS, NATIVE)
    tl.store(Out + src * stride_o + c, narrow(values, Out.dtype.element_ty, INTERP), mask=ok)


@dataclasses.dataclass(frozen=True)
class DequantTile:
    """Rows (``br``) x columns (``bc``) per program and warps; the extent along the block
    axis must be a multiple of 32 (whole scale blocks)."""

    br: int
    bc: int
    warps: int


#: Default GPU tiles by block axis, the fastest of ``benchmarks/triton_mxfp4.py --sweep`` on
#: the H200 (docs/notes/triton_mxfp4.md): few rows per tile measured fastest (8 x 512 at
#: 3.0-3.2 TB/s against 0.8-0.9 for 32 x 256); along axis 0 a tile spans one 32-row
#: scale block.
DEQUANT_TILES = {1: DequantTile(br=8, bc=512, warps=4), 0: DequantTile(br=32, bc=128, warps=4)}
