"""MX (OCP Microscaling) formats: quantize to E4M3 / E5M2 / E2M1 with E8M0 block scales,
the ``MXTensor`` container, and the grouped helpers MoE backends need.

See docs/mx_formats.md for the rules and where they come from.
"""

from grouped_gemm.mx.formats import BLOCK_SIZE, FORMATS, SCALE_RULES, MXFormat
from grouped_gemm.mx.grouped import MXRows, padded_row_offsets, quantize_mx_rows, quantize_mx_weight
from grouped_gemm.mx.quantize import quantize_mx
from grouped_gemm.mx.tensor import MXTensor

__all__ = [
    "BLOCK_SIZE",
    "FORMATS",
    "SCALE_RULES",
    "MXFormat",
    "MXRows",
    "MXTensor",
    "padded_row_offsets",
    "quantize_mx",
    "quantize_mx_rows",
    "quantize_mx_weight",
]
