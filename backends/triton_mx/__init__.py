"""Built-in Triton MX backends: persistent Triton grouped GEMMs on MX-quantized operands.

One kernel package (tile schedule, weight layouts, decoders, launches) serves every
backend it registers: ``triton_mxfp4`` (MXFP4 weights: the mxfp4, a8w4 and a16w4
recipes) and ``triton_mxfp8`` (the mxfp8 recipe: E4M3 activations and weights).
``tl.dot_scaled`` where the chip has MX MMA, a register-upcast kernel on Hopper (weights
decoded exactly to bf16 in registers), Triton's interpreter on the CPU. See
docs/triton_mxfp4.md and docs/triton_mxfp8.md.
"""

from __future__ import annotations

from grouped_gemm import Backend, hookimpl
from grouped_gemm.backends.triton_mx.mxfp4 import TritonMxfp4Backend
from grouped_gemm.backends.triton_mx.mxfp8 import TritonMxfp8Backend

__all__ = ["TritonMxfp4Backend", "TritonMxfp8Backend"]


@hookimpl
def grouped_gemm_backends() -> list[Backend]:
    return [TritonMxfp4Backend(), TritonMxfp8Backend()]
