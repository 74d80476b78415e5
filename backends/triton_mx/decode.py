"""Triton device functions that turn MX codes and E8M0 bytes into exact bf16 / fp32 values.

Every function here is exact: an E2M1 or E4M3 element times a power of two 2^(b - 127) is
representable in fp32 and, E2M1 having two significant bits and E4M3 four, in bf16 too
(bf16 shares fp32's exponent range, subnormals included). Rounding can therefore only come
from the matrix units' fp32 accumulation, as in the reference backend.

Two implementations of the E2M1 -> bf16 decode of the Hopper upcast kernel, which takes
int32 words of eight E2M1 codes, four element pairs (j, h = 0, 1; ``layouts.UpcastWeight``
says which elements), and returns eight bf16 tensors, output ``j + 4h`` the element (j, h):

- Both start from the pair's *decode pattern*: in each 16-bit lane h, the code's sign at
  bit 15 and its three magnitude bits at 8..6. Read as bf16 that is the E2M1 value times
  2^-126 (the E2M1 subnormal 0.5 lands on the bf16 subnormal 2^-127, exactly). The word
  stores each pair so that a rotation and a mask give its pattern (``E2M1_PIECES``: pair
  3 takes two rotations and a merge): 9 integer instructions a word. Plain nibbles took
  15, because a nibble's sign and magnitude are adjacent while the pattern holds them 7
  bits apart, so each needed a shift of its own.
- ``e2m1_words_to_bf16`` (portable, and what Triton's CPU interpreter runs): the patterns
  as fp32 bits, times 2^126 and the scale in fp32.
- ``e2m1_words_to_bf16_ptx`` (sm_90): the same on packed registers (``shf.l.wrap``,
  ``and``, one ``lop3``), then two ``mul.bf16x2``, by 2^126 and by the block scale, which
  give the value exactly for every scale byte: both factors are powers of two that bf16
  represents (2^-127 is a bf16 subnormal) and the products only round where the true
  result overflows, as fp32 would. With ``FOLD`` (every scale byte of the weight at most
  128) the 2^126 is part of the scale operand and one multiply does (``e8m0_to_bf16x2``).

A single exponent add (``bits + ((b - 127) << 7)``) would also be exact, but only for
nonzero normal codes and scale bytes in [2, 252]: zero and the E2M1 subnormal 0.5 need
selects, and packed 16-bit lanes need carries masked. The two multiplies cost one
``mul.bf16x2`` per element pair each, fewer instructions than those fix-ups, and are exact
everywhere, so the kernel uses them. (Instruction mix: docs/notes/triton_mxfp4.md.)

The E4M3 weights of ``triton_mxfp8`` come as pairs of int32 words, eight E4M3 bytes (the same
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
def to_fp32(x, INTERP: tl.constexpr):
    """A 16-bit float tile widened to fp32, exactly. Triton's interpreter (3.9) converts
    bf16 subnormals wrong (1e-39 -> 4.4e-39, 1e-40 -> 0), so there bf16 widens by a shift
    of its bits, as ``grouped_gemm.mx.triton_kernels.widen`` does."""
    if INTERP and x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def narrow(x, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """fp32 ``x`` rounded to nearest even in ``DTYPE``. Triton's interpreter (3.9) truncates
    fp32 -> bf16 and flushes or misplaces subnormals, so there bf16 rounds on the bits
    (NaN kept NaN; a carry into the exponent gives the next binade or infinity, as RNE)."""
    if INTERP and tl.bfloat16 == DTYPE:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(DTYPE)


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


#: The decode pattern's bits in each 16-bit lane: sign at 15, the magnitude (two exponent
#: bits, one mantissa bit) at 8..6. Read as bf16 that is the E2M1 value times 2^-126.
E2M1_PATTERN_MASK = tl.constexpr(0x81C081C0)
#: Where an E2M1 word stores its four element pairs (``layouts.UpcastWeight``): rotating the
#: word left by ``rotation`` and keeping ``mask`` gives pair p's decode pattern (element
#: (p, h) in lane h). Pairs 0-2 are one piece each (the rotated word, masked); pair 3 is two,
#: its bits 15, 7, 6 under rotation 6 and its bit 8 under rotation 14. No four rotations of
#: one 4-bit lane pattern tile a word, so one pair must come in pieces; this arrangement
#: (found by exhaustive search over rotations and splits) decodes a word in 9 integer
#: instructions, where the nibble order took 15.
E2M1_PIECES = (
    ((0, E2M1_PATTERN_MASK.value),),
    ((4, E2M1_PATTERN_MASK.value),),
    ((10, E2M1_PATTERN_MASK.value),),
    ((6, 0x80C080C0), (14, 0x01000100)),
)


def _e2m1_bit(pair: int, h: int, bit: int) -> int:
    target = (6, 7, 8, 15)[bit] + 16 * h  # where the decode pattern wants the code's bit
    rotation = next(r for r, mask in E2M1_PIECES[pair] if mask >> target & 1)
    return (target - rotation) % 32


#: ``E2M1_BITS[j][h][i]``: the bit of a stored word that holds bit i (0: mantissa, 1-2:
#: exponent, 3: sign) of the E2M1 code of element (j, h) (``layouts.UpcastWeight``).
E2M1_BITS = tuple(tuple(tuple(_e2m1_bit(j, h, i) for i in range(4)) for h in range(2)) for j in range(4))
E2M1_ROT1 = tl.constexpr(E2M1_PIECES[1][0][0])
E2M1_ROT2 = tl.constexpr(E2M1_PIECES[2][0][0])
E2M1_ROT3A, E2M1_MASK3A = tl.constexpr(E2M1_PIECES[3][0][0]), tl.constexpr(E2M1_PIECES[3][0][1])
E2M1_ROT3B, E2M1_MASK3B = tl.constexpr(E2M1_PIECES[3][1][0]), tl.constexpr(E2M1_PIECES[3][1][1])


@triton.jit
def rotate_left(u, n: tl.constexpr):
    """uint32 ``u`` rotated left by ``n`` bits (0 <= n < 32)."""
    if n == 0:
        return u
    return (u << n) | (u >> (32 - n))


@triton.jit
def e2m1_patterns(words):
    """int32 words in the stored arrangement (``E2M1_PIECES``) -> the four pairs' decode
    patterns (uint32, element (p, h) in lane h; see ``E2M1_PATTERN_MASK``)."""
    u = words.to(tl.uint32, bitcast=True)
    p3 = (rotate_left(u, E2M1_ROT3A) & E2M1_MASK3A) | (rotate_left(u, E2M1_ROT3B) & E2M1_MASK3B)
    return (
        u & E2M1_PATTERN_MASK,
        rotate_left(u, E2M1_ROT1) & E2M1_PATTERN_MASK,
        rotate_left(u, E2M1_ROT2) & E2M1_PATTERN_MASK,
        p3,
    )


@triton.jit
def _scale_factor(scale_bits):
    """The fp32 value of the bf16 multiplier in the low half of ``scale_bits``, by a shift:
    exact for the subnormal 2^-127 (scale byte 0) too, which Triton's interpreter converts
    wrong from bf16."""
    return ((scale_bits & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _lane_to_bf16(lane_bits, factor):
    """A lane's pattern, placed in the top half of an fp32 (where bf16 bits sit), -> its
    value times ``factor`` as bf16: pattern * 2^126 is the E2M1 value, exact in fp32;
    rounded on the bits (``narrow``), as ``mul.rn.bf16x2`` rounds, subnormals included."""
    return narrow(lane_bits.to(tl.float32, bitcast=True) * TWO_POW_126 * factor, tl.bfloat16, True)


@triton.jit
def e2m1_words_to_bf16(words, scale_bits, FOLD: tl.constexpr):
    """int32 words of eight E2M1 codes (``E2M1_PIECES``) -> eight bf16 tensors, output
    ``p + 4h`` the element (p, h), each value times its word's scale. ``scale_bits`` is
    ``e8m0_to_bf16x2(scale bytes, FOLD)``. Portable version."""
    factor = _scale_factor(scale_bits)
    if FOLD:
        factor = factor * 1.1754943508222875e-38  # 2^-126: _lane_to_bf16 already includes 2^126
    p0, p1, p2, p3 = e2m1_patterns(words)
    return (
        _lane_to_bf16(p0 << 16, factor),
        _lane_to_bf16(p1 << 16, factor),
        _lane_to_bf16(p2 << 16, factor),
        _lane_to_bf16(p3 << 16, factor),
        _lane_to_bf16(p0 & 0xFFFF0000, factor),
        _lane_to_bf16(p1 & 0xFFFF0000, factor),
        _lane_to_bf16(p2 & 0xFFFF0000, factor),
        _lane_to_bf16(p3 & 0xFFFF0000, factor),
    )


def _words_ptx(fold: bool) -> str:
    """PTX of the word decode: per pair, rotate the word (``shf.l.wrap``) so the pair's
    bits land on the decode pattern's positions and keep them (``and``; pair 3 merges its
    two pieces with one ``lop3``), which gives the bf16 pattern value * 2^-126 in each
    lane; then multiply by 2^126 (unless folded into the scale) and by the scale. 9
    integer instructions a word."""
    lines = ["{", ".reg .b32 r, v, big, p0, p1, p2, p3;", "mov.b32 big, 0x7e807e80;"]
    for p, pieces in enumerate(E2M1_PIECES):
        for i, (rotation, mask) in enumerate(pieces):
            src = "$8"
            if rotation:
                lines.append(f"shf.l.wrap.b32 r, $8, $8, {rotation};")
                src = "r"
            if i == 0:
                lines.append(f"and.b32 v, {src}, {mask:#010x};")
            else:
                lines.append(f"lop3.b32 v, {src}, v, {mask:#010x}, 0xec;")  # (src & mask) | v
        if not fold:
            lines.append("mul.rn.bf16x2 v, v, big;")
        lines.append(f"mul.rn.bf16x2 p{p}, v, $9;")
    lines += [f"mov.b32 {{${i}, ${i + 4}}}, p{i};" for i in range(4)]
    return "\n".join([*lines, "}"])


WORDS_PTX = tl.constexpr(_words_ptx(fold=False))
WORDS_PTX_FOLDED = tl.constexpr(_words_ptx(fold=True))


@triton.jit
def e2m1_words_to_bf16_ptx(words, scale_bits, FOLD: tl.constexpr):
    """sm_90 version of ``e2m1_words_to_bf16`` (see the module docstring); same results."""
    # $0..$7: outputs j + 4h; $8: the word; $9: the multiplier as bf16 in both halves.
    return tl.inline_asm_elementwise(
        asm=WORDS_PTX_FOLDED if FOLD else WORDS_PTX,
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r",
        args=[words, scale_bits],
        dtype=(tl.bfloat16,) * 8,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _byte_to_bf16(word, i: tl.constexpr, factor):
    return narrow(e4m3_to_fp32((word >> (8 * i)) & 0xFF) * factor, tl.bfloat16, True)


@triton.jit
def e4m3_words_to_bf16(low, high, scale_bits, FOLD: tl.constexpr):
    """Pairs of int32 words of four E4M3 bytes each -> eight bf16 tensors, each value times
    its words' scale, in the output order of ``e2m1_words_to_bf16``: output ``j + 4h`` is
    byte ``2 (j % 2) + h`` of ``low`` (j < 2) or ``high`` (``layouts_e4m3`` stores element
    pair (k, k + 1) so). ``scale_bits`` is ``e8m0_to_bf16x2(scale bytes, FOLD, 120)``.
    Portable version."""
    factor = _scale_factor(scale_bits)
    if FOLD:
        factor = factor * TWO_POW_MINUS_120  # 2^(e - 7) -> 2^(e - 127), exact in fp32
    lo = low.to(tl.uint32, bitcast=True)
    hi = high.to(tl.uint32, bitcast=True)
    return (
        _byte_to_bf16(lo, 0, factor),
        _byte_to_bf16(lo, 2, factor),
        _byte_to_bf16(hi, 0, factor),
        _byte_to_bf16(hi, 2, factor),
        _byte_to_bf16(lo, 1, factor),
        _byte_to_bf16(lo, 3, factor),
        _byte_to_bf16(hi, 1, factor),
        _byte_to_bf16(hi, 3, factor),
    )


def _e4m3_words_ptx(fold: bool) -> str:
    """PTX of the E4M3 word decode. Per byte pair (2j, 2j + 1) of the two words (low, high), one
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
    lines = ["{", ".reg .b32 x, v, big, p0, p1, p2, p3;", "mov.b32 big, 0x7b807b80;"]
    for j, (src, sel) in enumerate((("$8", "0x9180"), ("$8", "0xB3A2"), ("$9", "0x9180"), ("$9", "0xB3A2"))):
        lines += [f"prmt.b32 x, {src}, 0, {sel};", "shl.b32 x, x, 4;", "and.b32 v, x, 0x87f087f0;"]
        if not fold:
            lines.append("mul.rn.bf16x2 v, v, big;")
        lines.append(f"mul.rn.bf16x2 p{j}, v, $10;")
    lines += [f"mov.b32 {{${j}, ${j + 4}}}, p{j};" for j in range(4)]
    return "\n".join([*lines, "}"])


E4M3_WORDS_PTX = tl.constexpr(_e4m3_words_ptx(fold=False))
E4M3_WORDS_PTX_FOLDED = tl.constexpr(_e4m3_words_ptx(fold=True))


@triton.jit
def e4m3_words_to_bf16_ptx(low, high, scale_bits, FOLD: tl.constexpr):
    """sm_90 version of ``e4m3_words_to_bf16`` (see ``_e4m3_words_ptx``); same results on
    every non-NaN code."""
    # $0..$7: outputs; $8, $9: the low and high words; $10: the multiplier as bf16 in both halves.
    return tl.inline_asm_elementwise(
        asm=E4M3_WORDS_PTX_FOLDED if FOLD else E4M3_WORDS_PTX,
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r,r",
        args=[low, high, scale_bits],
        dtype=(tl.bfloat16,) * 8,
        is_pure=True,
        pack=1,
    )


@triton.jit
def bf16_dot(a, b, acc, INTERP: tl.constexpr):
    """``tl.dot`` of bf16 (or fp16) tiles into an fp32 accumulator. Triton's interpreter
    multiplies bf16 tiles as their raw 16-bit patterns, so there both are widened to fp32
    first (``to_fp32``; the products of 16-bit floats are exact in fp32 either way)."""
    if INTERP:
        return tl.dot(to_fp32(a, INTERP), to_fp32(b, INTERP), acc, input_precision="ieee")
    return tl.dot(a, b, acc)
