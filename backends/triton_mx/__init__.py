"""Built-in Triton backends: persistent Triton grouped GEMMs on MX-quantized and plain operands.

One kernel package (tile schedule, contraction loop, weight layouts, decoders, launches)
serves every backend it registers: ``triton_mxfp4`` (MXFP4 weights: the mxfp4, a8w4 and
a16w4 recipes), ``triton_mxfp8`` (the mxfp8 recipe: E4M3 activations and weights) and
``triton_grouped`` (plain bf16 / fp16 operands, fp32 results and fp32 wgrad accumulation;
the same schedule and loop with a plain ``tl.dot``). For MX: ``tl.dot_scaled`` where the
chip has MX MMA, a register-upcast kernel on Hopper (weights decoded exactly to bf16 in
registers), Triton's interpreter on the CPU. See docs/triton_mxfp4.md, docs/triton_mxfp8.md
and docs/backends.md (``triton_grouped``).
"""

from __future__ import annotations

from grouped_gemm import Backend, hookimpl
from grouped_gemm.backends.triton_mx.grouped import TritonGroupedBackend
from grouped_gemm.backends.triton_mx.mxfp4 import TritonMxfp4Backend
from grouped_gemm.backends.triton_mx.mxfp8 import TritonMxfp8Backend

__all__ = ["TritonGroupedBackend", "TritonMxfp4Backend", "TritonMxfp8Backend"]


@hookimpl
def grouped_gemm_backends() -> list[Backend]:
    return [TritonMxfp4Backend(), TritonMxfp8Backend(), TritonGroupedBackend()]
