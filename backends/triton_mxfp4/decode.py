"""Triton device functions that turn MX codes and E8M0 bytes into exact bf16 / fp32 values.

Every function here is exact: an E2M1 or E4M3 element times a power of two 2^(b - 127) is
representable in fp32 and, E2M1 having two significant bits and E4M3 four, in bf16 too
(bf16 shares fp32's exponent range, subnormals included). Rounding can therefore only come
from the matrix units' fp32 accumulation, as in the reference backend.

Two implementations of the E2M1 -> bf16 decode used by the Hopper upcast kernel:

- ``e2m1_pair_to_bf16`` (portable, and what Triton's CPU interpreter runs): integer ops on
  fp32 bit patterns, then one fp32 multiply by the scale.
- ``e2m1_pair_to_bf16_ptx`` (sm_90): PTX on packed registers. Four code bytes at a time:
  ``prmt`` spreads two bytes into the two 16-bit lanes of a register, two shifts and one
  ``lop3`` place each nibble's sign at bit 15 and its three magnitude bits at bits 6..8
  of its lane. That bit pattern, read as bf16, is the E2M1 value times 2^-126 (the E2M1
  subnormal 0.5 lands on the bf16 subnormal 2^-127, exactly), so two ``mul.bf16x2``
  by 2^126 and by the block scale give the value, exact for every scale byte: both
  factors are powers of two that bf16 represents (2^-127 is a bf16 subnormal) and the
  products only round where the true result overflows, as fp32 would.

A single exponent add (``bits + ((b - 127) << 7)``) would also be exact, but only for
nonzero normal codes and scale bytes in [2, 252]: zero and the E2M1 subnormal 0.5 need
selects, and packed 16-bit lanes need carries masked. The two multiplies cost one
``mul.bf16x2`` per element pair each, fewer instructions than those fix-ups, and are exact
everywhere, so the kernel uses them. (Measured instruction mix: docs/notes/triton_mxfp4.md.)
"""

from __future__ import annotations

import triton
import triton.language as tl

#: 2^126: the E2M1-in-bf16 bit trick above yields value * 2^-126.
TWO_POW_126 = tl.constexpr(8.507059173023462e37)


@triton.jit
def e8m0_to_fp32(e):
    """E8M0 bytes -> fp32 2^(e - 127); byte 0 is 2^-127 (an fp32 subnormal), 0xFF is NaN."""
    e = e.to(tl.uint32)
    bits = tl.where(e == 0, 0x00400000, e << 23)
    bits = tl.where(e == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e8m0_to_bf16(e):
    """E8M0 bytes -> bf16 2^(e - 127); byte 0 is 2^-127 (a bf16 subnormal), 0xFF is NaN."""
    e = e.to(tl.uint16)
    bits = tl.where(e == 0, 0x0040, e << 7)
    bits = tl.where(e == 255, 0x7FC0, bits)
    return bits.to(tl.bfloat16, bitcast=True)


@triton.jit
def e2m1_to_fp32(codes):
    """E2M1 codes (0..15, sign in bit 3) -> fp32 values (exact)."""
    c = codes.to(tl.uint32)
    raw = ((c & 8) << 28) | ((c & 7) << 22)
    return raw.to(tl.float32, bitcast=True) * TWO_POW_126


@triton.jit
def e4m3_to_fp32(codes):
    """E4M3 (OCP, 'fn') bytes -> fp32 values (exact; 0x7F / 0xFF are NaN)."""
    c = codes.to(tl.uint32)
    exp = (c >> 3) & 15
    mant = c & 7
    normal = ((exp + 120) << 23) | (mant << 20)
    mag = tl.where(exp == 0, mant.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))
    mag = tl.where((c & 0x7F) == 0x7F, float("nan"), mag)
    return tl.where((c & 0x80) != 0, -mag, mag)


@triton.jit
def mx_to_fp32(codes, scale, FMT: tl.constexpr):
    """Unpacked MX element codes (uint8) times their block scale bytes -> fp32."""
    if FMT == "e2m1":
        v = e2m1_to_fp32(codes)
    else:
        v = e4m3_to_fp32(codes)
    return v * e8m0_to_fp32(scale)


@triton.jit
def e2m1_pair_to_bf16(packed, scale_lo, scale_hi):
    """Packed E2M1 bytes -> (low-nibble values * 2^(scale_lo-127), high-nibble values *
    2^(scale_hi-127)) in bf16. Portable version; the scales broadcast against ``packed``."""
    lo = e2m1_to_fp32(packed & 15) * e8m0_to_fp32(scale_lo)
    hi = e2m1_to_fp32(packed >> 4) * e8m0_to_fp32(scale_hi)
    return lo.to(tl.bfloat16), hi.to(tl.bfloat16)


@triton.jit
def e2m1_pair_to_bf16_ptx(packed, scale_lo, scale_hi):
    """sm_90 version of ``e2m1_pair_to_bf16`` (see the module docstring); same results."""
    s_lo = tl.broadcast_to(e8m0_to_bf16(scale_lo), packed.shape)
    s_hi = tl.broadcast_to(e8m0_to_bf16(scale_hi), packed.shape)
    # $0,$1: low nibbles of bytes (0,1), (2,3); $2,$3: high nibbles; $4: four code bytes;
    # $5,$6: low scales, $7,$8: high scales (bf16 pairs in the same element order).
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 u, v, a, b, w4, big;
        mov.b32 big, 0x7e807e80;
        prmt.b32 u, $4, 0, 0x4140;
        shl.b32 a, u, 6;
        shl.b32 b, u, 12;
        lop3.b32 v, a, b, 0x81c081c0, 0xa8;
        mul.rn.bf16x2 v, v, big;
        mul.rn.bf16x2 $0, v, $5;
        prmt.b32 u, $4, 0, 0x4342;
        shl.b32 a, u, 6;
        shl.b32 b, u, 12;
        lop3.b32 v, a, b, 0x81c081c0, 0xa8;
        mul.rn.bf16x2 v, v, big;
        mul.rn.bf16x2 $1, v, $6;
        shr.b32 w4, $4, 4;
        prmt.b32 u, w4, 0, 0x4140;
        shl.b32 a, u, 6;
        shl.b32 b, u, 12;
        lop3.b32 v, a, b, 0x81c081c0, 0xa8;
        mul.rn.bf16x2 v, v, big;
        mul.rn.bf16x2 $2, v, $7;
        prmt.b32 u, w4, 0, 0x4342;
        shl.b32 a, u, 6;
        shl.b32 b, u, 12;
        lop3.b32 v, a, b, 0x81c081c0, 0xa8;
        mul.rn.bf16x2 v, v, big;
        mul.rn.bf16x2 $3, v, $8;
        }""",
        constraints="=r,=r,=r,=r,r,r,r,r,r",
        args=[packed, s_lo, s_hi],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def bf16_dot(a, b, acc, INTERP: tl.constexpr):
    """``tl.dot`` of bf16 tiles into an fp32 accumulator. Triton's interpreter multiplies
    bf16 tiles as their raw 16-bit patterns, so there both are widened to fp32 first (the
    products of bf16 numbers are exact in fp32 either way)."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)
