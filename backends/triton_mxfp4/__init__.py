"""Built-in backend ``triton_mxfp4``: persistent Triton grouped GEMMs with MXFP4 weights.

fwd / dgrad / wgrad for the mxfp4 (a4w4), a8w4 and a16w4 recipes; ``tl.dot_scaled`` where
the chip has MX MMA, a register-upcast kernel on Hopper, Triton's interpreter on the CPU.
See docs/triton_mxfp4.md.
"""

from __future__ import annotations

from grouped_gemm.backends.triton_mxfp4.backend import TritonMxfp4Backend

from grouped_gemm import hookimpl

__all__ = ["TritonMxfp4Backend"]


@hookimpl
def grouped_gemm_backends() -> list[TritonMxfp4Backend]:
    return [TritonMxfp4Backend()]
