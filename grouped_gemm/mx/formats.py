"""MX element formats, E8M0 scale constants and the scale rules' names.

Numbers from the OCP Microscaling Formats (MX) Specification v1.0, section 5 (element
formats) and 5.4 (E8M0): E4M3 (bias 7, no Inf, one NaN per sign, max 448), E5M2 (bias 15,
IEEE-like, max 57344), E2M1 (bias 1, no Inf/NaN, max 6). ``emax`` is the exponent of the
largest normal element (the OCP "emax_elem"); ``max_mantissa`` is the fp32 mantissa field
of ``max_value`` (448 = 1.75 * 2^8 -> 0x600000), which the RCEIL rule compares against.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Literal

import torch

FormatName = Literal["e4m3", "e5m2", "e2m1"]
ScaleRuleName = Literal["rceil", "floor", "even"]

#: Scale rules, in the order the kernels number them.
SCALE_RULES: tuple[str, ...] = ("floor", "rceil", "even")

#: The OCP MX block size; other powers of two are accepted for experiments.
BLOCK_SIZE = 32
BLOCK_SIZES = (2, 4, 8, 16, 32, 64, 128, 256)

#: E8M0: byte b is 2^(b - 127); 0xFF is NaN; byte 0 is 2^-127 (there is no zero).
E8M0_BIAS = 127
E8M0_NAN = 0xFF

#: Input dtypes the quantizer accepts (amax is taken in their own precision).
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fp32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


@dataclasses.dataclass(frozen=True)
class MXFormat:
    """One MX element format: its bit layout and the constants the quantizers use."""

    name: str
    bits: int
    mbits: int
    bias: int
    emax: int
    max_value: float
    storage: torch.dtype

    @property
    def max_bits(self) -> int:
        """fp32 bit pattern of ``max_value`` (saturation bound, compared as an integer)."""
        return _fp32_bits(self.max_value)

    @property
    def max_mantissa(self) -> int:
        """fp32 mantissa field of ``max_value``."""
        return self.max_bits & 0x7FFFFF

    @property
    def per_byte(self) -> int:
        """Elements stored per byte of ``MXTensor.data`` (2 for E2M1)."""
        return 8 // self.bits

    @property
    def problem_format(self) -> str:
        """How ``Problem.a_format`` / ``b_format`` names a pre-quantized operand."""
        return f"mx_{self.name}"


FORMATS: dict[str, MXFormat] = {
    "e4m3": MXFormat("e4m3", 8, 3, 7, 8, 448.0, torch.float8_e4m3fn),
    "e5m2": MXFormat("e5m2", 8, 2, 15, 15, 57344.0, torch.float8_e5m2),
    "e2m1": MXFormat("e2m1", 4, 1, 1, 2, 6.0, torch.uint8),
}
