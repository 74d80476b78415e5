"""MX -> bf16 decode of an activation or gradient operand (the Hopper path's first pass).

Hopper's wgmma reads its right operand from shared memory, so an activation upcast inside
the GEMM would make the trip through shared memory that the weights avoid. Instead the
Hopper path decodes MX activations once, exactly, to bf16 (E4M3 and E2M1 values times
powers of two are bf16 numbers), then runs the bf16 x E2M1 kernel: one extra pass over
the activations, a few percent of a compute-bound GEMM. The result is bit-identical to
``MXTensor.dequantize(torch.bfloat16)``.
"""

from __future__ import annotations

import triton
import triton.language as tl
from grouped_gemm.backends.triton_mxfp4.decode import mx_to_fp32


@triton.jit
def dequant_kernel(
    D,
    stride_dr,
    S,
    stride_sr,
    Out,
    stride_or,
    rows,
    cols,
    AXIS: tl.constexpr,
    FMT: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
):
    """Decode a 2-D MX tensor blocked along ``AXIS`` (E2M1 packed along it) into ``Out``."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    ok = (r < rows)[:, None] & (c < cols)[None, :]
    r64 = r.to(tl.int64)
    if AXIS == 1:
        scale = tl.load(S + r64[:, None] * stride_sr + (c // 32)[None, :], mask=ok, other=0)
        if FMT == "e2m1":
            byte = tl.load(D + r64[:, None] * stride_dr + (c // 2)[None, :], mask=ok, other=0)
            codes = tl.where((c % 2 == 0)[None, :], byte & 15, byte >> 4)
        else:
            codes = tl.load(D + r64[:, None] * stride_dr + c[None, :], mask=ok, other=0)
    else:
        scale = tl.load(S + (r64 // 32)[:, None] * stride_sr + c[None, :], mask=ok, other=0)
        if FMT == "e2m1":
            byte = tl.load(D + (r64 // 2)[:, None] * stride_dr + c[None, :], mask=ok, other=0)
            codes = tl.where((r % 2 == 0)[:, None], byte & 15, byte >> 4)
        else:
            codes = tl.load(D + r64[:, None] * stride_dr + c[None, :], mask=ok, other=0)
    value = mx_to_fp32(codes, scale, FMT)
    tl.store(Out + r64[:, None] * stride_or + c[None, :], value.to(Out.dtype.element_ty), mask=ok)


def grid(rows: int, cols: int, br: int, bc: int) -> tuple[int, int]:
    return (triton.cdiv(rows, br), triton.cdiv(cols, bc))
