"""Built-in compiled backend ``hip_mxfp8``: an MXFP8 grouped GEMM in CUDA / HIP C++,
compiled on first use into a per-user cache (see ``build``) and docs/backends.md."""

from __future__ import annotations

from grouped_gemm import hookimpl
from grouped_gemm.backends.hip_mxfp8.backend import HipMxfp8Backend

__all__ = ["HipMxfp8Backend"]


@hookimpl
def grouped_gemm_backends() -> list[HipMxfp8Backend]:
    return [HipMxfp8Backend()]
