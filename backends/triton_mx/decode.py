"""Triton device functions that turn MX codes and E8M0 bytes into exact bf16 / fp32 values.

Every function here is exact: an E2M1 or E4M3 element times a power of two 2^(b - 127) is
representable in fp32 and, E2M1 having two significant bits and E4M3 four, in bf16 too
(bf16 shares fp32's exponent range, subnormals included). Rounding can therefore only come
from the matrix units' fp32 accumulation, as in the reference backend.

Two implementations of the E2M1 -> bf16 decode of the Hopper upcast kernel, which takes
int32 words of eight E2M1 codes (nibble i at bits 4i; see ``layouts.UpcastWeight`` for
which elements they are) and returns eight bf16 tensors, one per nibble position:

- ``e2m1_words_to_bf16`` (portable, and what Triton's CPU interpreter runs): integer ops on
  fp32 bit patterns, then one fp32 multiply by the scale.
- ``e2m1_words_to_bf16_ptx`` (sm_90): PTX on packed registers. Nibbles i and i + 4 sit 16
  bits apart, so shifting the word moves both codes alike: one shift puts their three
  magnitude bits at bits 6..8 of the two 16-bit lanes, another (none for i = 3) their
  signs at bits 15 and 31, and an ``and`` and a ``lop3`` keep exactly those bits. That
  pattern, read as bf16, is the E2M1 value times 2^-126 (the E2M1 subnormal 0.5 lands on the bf16
  subnormal 2^-127, exactly), so two ``mul.bf16x2``, by 2^126 and by the block scale,
  give the value, exact for every scale byte: both factors are powers of two that bf16
  represents (2^-127 is a bf16 subnormal) and the products only round where the true
  result overflows, as fp32 would. With ``FOLD`` (every scale byte of the weight at most
  128) the 2^126 is part of the scale operand and one multiply does (``e8m0_to_bf16x2``).

A single exponent add (``bits + ((b - 127) << 7)``) would also be exact, but only for
nonzero normal codes and scale bytes in [2, 252]: zero and the E2M1 subnormal 0.5 need
selects, and packed 16-bit lanes need carries masked. The two multiplies cost one
``mul.bf16x2`` per element pair each, fewer instructions than those fix-ups, and are exact
everywhere, so the kernel uses them. (Instruction mix: docs/notes/triton_mxfp4.md.)

The E4M3 weights of ``triton_mxfp8`` come as int64 words of eight E4M3 bytes (the same
fragment positions: ``layouts_e4m3``), decoded the same two ways (``e4m3_words_to_bf16``
and ``e4m3_words_to_bf16_ptx``): there the bf16 bit trick yields value * 2^-120.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: 2^126: the E2M1-in-bf16 bit trick above yields value * 2^-126.
TWO_POW_126 = tl.constexpr(8.507059173023462e37)
#: 2^-120: undoes the 2^120 an E4M3 ``FOLD`` multiplier carries (``e8m0_to_bf16x2``).
TWO_POW_MINUS_120 = tl.constexpr(7.52316384526264e-37)


@triton.jit
def e8m0_to_fp32(e):
    """E8M0 bytes -> fp32 2^(e - 127); byte 0 is 2^-127 (an fp32 subnormal), 0xFF is NaN."""
    e = e.to(tl.uint32)
    bits = tl.where(e == 0, 0x00400000, e << 23)
    bits = tl.where(e == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_to_fp32(codes):
    """E2M1 codes (0..15, sign in bit 3) -> fp32 values (exact)."""
    c = codes.to(tl.uint32)
    raw = ((c & 8) << 28) | ((c & 7) << 22)
    return raw.to(tl.float32, bitcast=True) * TWO_POW_126


@triton.jit
def e4m3_to_fp32(codes):
    """E4M3 (OCP, 'fn') bytes -> fp32 values (exact; 0x80 is -0, 0x7F / 0xFF are NaN). The
    sign is set as a bit, so -0 stays -0. Subnormal codes go through an fp32 multiply of
    normal numbers (mantissa x 2^-9), never through fp32 subnormals."""
    c = codes.to(tl.uint32)
    exp = (c >> 3) & 15
    mant = c & 7
    normal = ((exp + 120) << 23) | (mant << 20)
    mag = tl.where(exp == 0, mant.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))
    mag = tl.where((c & 0x7F) == 0x7F, float("nan"), mag)
    return (mag.to(tl.uint32, bitcast=True) | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def e5m2_to_fp32(codes):
    """E5M2 bytes -> fp32 values (exact): an E5M2 byte is the top byte of the fp16 with the
    same value (infinities and NaNs included)."""
    return (codes.to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e8m0_to_bf16x2(e, FOLD: tl.constexpr, SHIFT: tl.constexpr = 126):
    """E8M0 bytes -> int32 holding the bf16 multiplier of the decode in both 16-bit halves
    (the scale operand of ``mul.bf16x2``).

    Without ``FOLD``: 2^(e - 127); byte 0 is 2^-127 (a bf16 subnormal), 0xFF is NaN.
    ``e * 0x00800080`` puts e in both exponent fields; the two special bytes (those with
    ``e - 1`` outside [0, 253] as unsigned) also get the mantissa bit 0x40.
    With ``FOLD``: 2^(e - 127 + SHIFT), the decode's 2^SHIFT folded in (E2M1: 126, E4M3:
    120); the caller guarantees e + SHIFT <= 254 (E2M1: bytes <= 128, E4M3: <= 134), so
    the exponent field is always normal."""
    t = e.to(tl.uint32)
    if FOLD:
        return ((t + SHIFT) * 0x00800080).to(tl.int32, bitcast=True)
    both = t * 0x00800080
    special = (t - 1) > 253
    return tl.where(special, both | 0x00400040, both).to(tl.int32, bitcast=True)


@triton.jit
def _nibble_to_bf16(words, i: tl.constexpr, factor):
    return (e2m1_to_fp32((words >> (4 * i)) & 15) * factor).to(tl.bfloat16)


@triton.jit
def e2m1_words_to_bf16(words, scale_bits, FOLD: tl.constexpr):
    """int32 words of eight E2M1 codes -> eight bf16 tensors (nibble 0 first), each value
    times its word's scale. ``scale_bits`` is ``e8m0_to_bf16x2(scale bytes, FOLD)``.
    Portable version."""
    factor = (scale_bits & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True).to(tl.float32)
    if FOLD:
        factor = factor * 1.1754943508222875e-38  # 2^-126: e2m1_to_fp32 already includes 2^126
    return (
        _nibble_to_bf16(words, 0, factor),
        _nibble_to_bf16(words, 1, factor),
        _nibble_to_bf16(words, 2, factor),
        _nibble_to_bf16(words, 3, factor),
        _nibble_to_bf16(words, 4, factor),
        _nibble_to_bf16(words, 5, factor),
        _nibble_to_bf16(words, 6, factor),
        _nibble_to_bf16(words, 7, factor),
    )


def _words_ptx(fold: bool) -> str:
    """PTX of the word decode: per nibble pair (i, i + 4), shift the word so the two codes'
    magnitude bits land on bits 6..8 of their 16-bit lanes and, separately, so their sign
    bits land on bits 15 and 31; mask and merge (``and`` + ``lop3``), which gives the bf16
    pattern value * 2^-126; then multiply by 2^126 (unless folded into the scale) and by
    the scale. Nibble pair 3's signs are in place already: 4 integer instructions per pair,
    3 for the last."""
    lines = ["{", ".reg .b32 a, b, v, big, p0, p1, p2, p3;", "mov.b32 big, 0x7e807e80;"]
    for i in range(4):
        magnitude = 6 - 4 * i
        lines.append(f"shl.b32 a, $8, {magnitude};" if magnitude > 0 else f"shr.b32 a, $8, {-magnitude};")
        if i < 3:
            lines += [f"shl.b32 b, $8, {12 - 4 * i};", "and.b32 b, b, 0x80008000;"]
        else:
            lines.append("and.b32 b, $8, 0x80008000;")
        lines.append("lop3.b32 v, a, b, 0x01c001c0, 0xec;")  # (a & c) | b
        if not fold:
            lines.append("mul.rn.bf16x2 v, v, big;")
        lines.append(f"mul.rn.bf16x2 p{i}, v, $9;")
    lines += [f"mov.b32 {{${i}, ${i + 4}}}, p{i};" for i in range(4)]
    return "\n".join([*lines, "}"])


WORDS_PTX = tl.constexpr(_words_ptx(fold=False))
WORDS_PTX_FOLDED = tl.constexpr(_words_ptx(fold=True))


@triton.jit
def e2m1_words_to_bf16_ptx(words, scale_bits, FOLD: tl.constexpr):
    """sm_90 version of ``e2m1_words_to_bf16`` (see the module docstring); same results."""
    # $0..$7: nibbles 0..7; $8: the word; $9: the multiplier as bf16 in both halves.
    return tl.inline_asm_elementwise(
        asm=WORDS_PTX_FOLDED if FOLD else WORDS_PTX,
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r",
        args=[words, scale_bits],
        dtype=(tl.bfloat16,) * 8,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _byte_to_bf16(words, i: tl.constexpr, factor):
    return (e4m3_to_fp32((words >> (8 * i)) & 0xFF) * factor).to(tl.bfloat16)


@triton.jit
def e4m3_words_to_bf16(words, scale_bits, FOLD: tl.constexpr):
    """int64 words of eight E4M3 bytes -> eight bf16 tensors, each value times its word's
    scale, in the nibble order of ``e2m1_words_to_bf16``: output ``j + 4h`` is byte
    ``2j + h`` (``layouts_e4m3`` stores element pair (k, k + 1) in bytes 2j, 2j + 1).
    ``scale_bits`` is ``e8m0_to_bf16x2(scale bytes, FOLD, 120)``. Portable version."""
    factor = (scale_bits & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True).to(tl.float32)
    if FOLD:
        factor = factor * TWO_POW_MINUS_120  # 2^(e - 7) -> 2^(e - 127), exact in fp32
    w = words.to(tl.uint64, bitcast=True)
    return (
        _byte_to_bf16(w, 0, factor),
        _byte_to_bf16(w, 2, factor),
        _byte_to_bf16(w, 4, factor),
        _byte_to_bf16(w, 6, factor),
        _byte_to_bf16(w, 1, factor),
        _byte_to_bf16(w, 3, factor),
        _byte_to_bf16(w, 5, factor),
        _byte_to_bf16(w, 7, factor),
    )


def _e4m3_words_ptx(fold: bool) -> str:
    """PTX of the E4M3 word decode. Per byte pair (2j, 2j + 1) of the 64-bit word, one
    ``prmt`` puts byte 2j in the low byte of the low 16-bit lane and its sign replicated in
    the lane's high byte (byte 2j + 1 likewise in the high lane); shifting left by 4 and
    masking with 0x87F0 per lane leaves sign at bit 15 and the seven exponent / mantissa
    bits at 4..10: the bf16 pattern of the E4M3 value times 2^-120, for normal and
    subnormal codes alike (an E4M3 subnormal m/8 * 2^-6 lands on the bf16 subnormal
    m/8 * 2^-126). Then multiply by 2^120 (unless folded into the scale) and by the scale:
    powers of two, so exact, the product rounding only where the true value leaves bf16's
    range, as ``MXTensor.dequantize`` does. E4M3 NaN codes (0x7F, 0xFF) decode as 480: the
    layout builder gives blocks that hold one a NaN scale instead (``layouts_e4m3``).
    3 integer instructions per pair."""
    lines = ["{", ".reg .b32 lo, hi, x, v, big, p0, p1, p2, p3;", "mov.b64 {lo, hi}, $8;", "mov.b32 big, 0x7b807b80;"]
    for j, (src, sel) in enumerate((("lo", "0x9180"), ("lo", "0xB3A2"), ("hi", "0x9180"), ("hi", "0xB3A2"))):
        lines += [f"prmt.b32 x, {src}, 0, {sel};", "shl.b32 x, x, 4;", "and.b32 v, x, 0x87f087f0;"]
        if not fold:
            lines.append("mul.rn.bf16x2 v, v, big;")
        lines.append(f"mul.rn.bf16x2 p{j}, v, $9;")
    lines += [f"mov.b32 {{${j}, ${j + 4}}}, p{j};" for j in range(4)]
    return "\n".join([*lines, "}"])


E4M3_WORDS_PTX = tl.constexpr(_e4m3_words_ptx(fold=False))
E4M3_WORDS_PTX_FOLDED = tl.constexpr(_e4m3_words_ptx(fold=True))


@triton.jit
def e4m3_words_to_bf16_ptx(words, scale_bits, FOLD: tl.constexpr):
    """sm_90 version of ``e4m3_words_to_bf16`` (see ``_e4m3_words_ptx``); same results on
    every non-NaN code."""
    # $0..$7: outputs; $8: the 64-bit word; $9: the multiplier as bf16 in both halves.
    return tl.inline_asm_elementwise(
        asm=E4M3_WORDS_PTX_FOLDED if FOLD else E4M3_WORDS_PTX,
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,l,r",
        args=[words, scale_bits],
        dtype=(tl.bfloat16,) * 8,
        is_pure=True,
        pack=1,
    )


@triton.jit
def bf16_dot(a, b, acc, INTERP: tl.constexpr):
    """``tl.dot`` of bf16 (or fp16) tiles into an fp32 accumulator. Triton's interpreter
    multiplies bf16 tiles as their raw 16-bit patterns, so there both are widened to fp32
    first (the products of 16-bit floats are exact in fp32 either way)."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)
