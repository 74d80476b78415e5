"""The torch MX quantizer: the readable definition of every rule, used on the CPU.

Works on the fp32 bit patterns of the input (bf16 and fp16 widen to fp32 exactly, so the
block amax is the input's own). Per block of ``block_size`` elements along the last axis:

1. ``amax`` = the largest magnitude, as fp32 bits (for non-negative floats integer order is
   float order, so one integer max finds it; NaN / Inf have the largest patterns).
2. The scale exponent from amax, by rule (``scale_exponent``); NaN / Inf blocks get
   byte 0xFF and zero elements.
3. Elements: ``x * 2^-e`` as an exact power-of-two multiply (``2^-e`` is built from bits,
   never from a division that could underflow), saturated to ±max, rounded to nearest
   even: fp8 by torch's own conversion, E2M1 by comparing against the midpoints of its
   value grid (ties to the even code).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grouped_gemm.mx.formats import E8M0_BIAS, E8M0_NAN, MXFormat
from grouped_gemm.mx.tensor import MXTensor

_ABS = 0x7FFFFFFF
_FINITE_LIMIT = 0x7F800000  # fp32 bits of +Inf: magnitudes at or above it are Inf / NaN
_FLT_MAX_BITS = 0x7F7FFFFF

# E2M1 grid 0, .5, 1, 1.5, 2, 3, 4, 6: each midpoint, and whether a tie there rounds up
# (to the even code above) or down (to the even code below).
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def scale_exponent(amax_bits: torch.Tensor, fmt: MXFormat, rule: str) -> torch.Tensor:
    """Unbiased E8M0 exponent per block (int32, in [-127, 127]) from fp32 amax bits.

    - ``floor`` (OCP MX v1.0 section 6.3): ``floor(log2(amax)) - emax``.
    - ``rceil`` (NVIDIA): the smallest power of two >= ``amax / max`` where the quotient is
      the fp32 (round-to-nearest) quotient and any quotient <= 2^-127 gives 2^-127. With
      ``amax = 1.m * 2^E`` and ``max = 1.M * 2^emax`` the exact ceiling is
      ``E - emax + (m > M)``; the fp32 quotient only differs from the exact one where it
      is an fp32 subnormal just above 2^-127 (``E - emax + 1 == -126`` and ``m == M + 1``
      ulp), where it rounds down to 2^-127. Zero and fp32-subnormal amax give 2^-127.
    - ``even`` (AMD Quark): amax rounded to ``mbits + 1`` significant bits, ties away
      from zero (add half an ulp of that precision to the bits; a carry bumps the
      exponent), then ``floor``.
    """
    e_field = amax_bits >> 23
    if rule == "floor":
        exp = e_field - 127 - fmt.emax
    elif rule == "rceil":
        mant = amax_bits & 0x7FFFFF
        exp = e_field - 127 - fmt.emax + (mant > fmt.max_mantissa).to(torch.int32)
        exp = torch.where((exp == -126) & (mant == fmt.max_mantissa + 1), -127, exp)
        exp = torch.where(e_field == 0, -127, exp)
    else:
        rounded = torch.clamp(amax_bits, max=_FLT_MAX_BITS) + (1 << (22 - fmt.mbits))
        exp = (rounded >> 23) - 127 - fmt.emax
    return torch.clamp(exp, -E8M0_BIAS, E8M0_BIAS)


def encode_e2m1(v: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by the scale) -> E2M1 codes, nearest-even, saturating."""
    a = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for midpoint, tie_up in _E2M1_MIDPOINTS:
        code += (a >= midpoint) if tie_up else (a > midpoint)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``(..., L)`` -> bytes ``(..., L/2)``, element 2i in the low nibble."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def quantize(t: torch.Tensor, fmt: MXFormat, axis: int, rule: str, block_size: int, pad: int) -> MXTensor:
    """Quantize validated arguments (``axis`` non-negative, ``pad`` zeros to append)."""
    x = t.movedim(axis, -1)
    if pad:
        x = F.pad(x, (0, pad))
    lead = x.shape[:-1]
    blocks = x.reshape(*lead, x.shape[-1] // block_size, block_size).to(torch.float32)
    amax_bits = (blocks.view(torch.int32) & _ABS).amax(dim=-1)
    exp = scale_exponent(amax_bits, fmt, rule)
    nonfinite = amax_bits >= _FINITE_LIMIT
    scale = torch.where(nonfinite, E8M0_NAN, exp + E8M0_BIAS).to(torch.uint8)
    inv_scale = ((E8M0_BIAS - exp) << 23).view(torch.float32)  # 2^-exp, a normal fp32 for every exp used
    v = torch.where(nonfinite.unsqueeze(-1), 0.0, blocks * inv_scale.unsqueeze(-1))
    v = v.reshape(*lead, x.shape[-1])
    if fmt.name == "e2m1":
        data = pack_e2m1(encode_e2m1(v))
    else:
        data = v.clamp(-fmt.max_value, fmt.max_value).to(fmt.storage)
    return MXTensor(
        data=data.movedim(-1, axis).contiguous(),
        scale=scale.movedim(-1, axis).contiguous(),
        fmt=fmt.name,
        axis=axis,
        shape=tuple(t.shape),
        pad=pad,
        block_size=block_size,
    )
