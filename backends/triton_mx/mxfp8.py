"""The ``triton_mxfp8`` backend: the mxfp8 recipe (E4M3 activations and weights, E4M3 or
E5M2 gradients; dgrad also with grad_format None, dy unquantized in bf16) on the Triton MX
kernels ``triton_mxfp4`` also runs.

Path by chip (``Problem.device``): with MX block-scaled MMA (``DeviceInfo.has("scaled_mma")``:
gfx950, sm_100) the ``tl.dot_scaled`` kernel, E4M3 (or E5M2) x E4M3; otherwise (sm_90, and
the CPU interpreter) the upcast kernel: E4M3 weights decoded exactly to bf16 in registers
(``layouts_e4m3``), activations decoded once to bf16 by the dequant kernel. wgrad: dy and
x quantized along the tokens per group, then ``tl.dot_scaled`` or their exact bf16 decodes
through the same wgrad kernel. Every product is exact in fp32 before accumulation, as in
the reference backend.
"""

from __future__ import annotations

from typing import Any

import torch

from grouped_gemm import Backend, BackendSpec, GroupedInputs, Problem, Reason, __version__
from grouped_gemm.backends.triton_mx import calls, launch, layouts_e4m3, operands

_GRAD_FORMATS = ("e4m3", "e5m2")


class TritonMxfp8Backend(Backend):
    """Persistent Triton grouped kernels for the mxfp8 recipe (fwd, dgrad, wgrad)."""

    spec = BackendSpec(
        name="triton_mxfp8",
        version=f"{__version__}+{layouts_e4m3.LAYOUT}.{launch.UPCAST_REVISION}",
        description="persistent Triton MXFP8 grouped GEMM: dot_scaled (gfx950, sm_100), exact bf16 upcast (sm_90)",
        recipes=frozenset({"mxfp8"}),
        mx_formats=frozenset({"e4m3", "e5m2"}),
        priority=80,
        **calls.KERNEL_CAPABILITIES,
    )

    def check(self, problem: Problem) -> list[Reason]:
        reasons = launch.placement_reasons(problem)
        grad = problem.grad_format
        if (problem.op == "wgrad" and grad not in _GRAD_FORMATS) or (problem.op == "dgrad" and grad == "e2m1"):
            allowed = "e4m3 or e5m2" if problem.op == "wgrad" else "e4m3, e5m2 or None (dy unquantized, bf16)"
            reasons.append(Reason("recipe", f"{problem.op} with grad_format {grad}; this backend runs {allowed}"))
        if problem.op == "wgrad":
            if problem.a_format.startswith("mx_") or problem.b_format.startswith("mx_"):
                reasons.append(
                    Reason(
                        "layout",
                        "wgrad quantizes dy and x itself (per-group token blocks); pass high-precision tensors",
                    )
                )
            return reasons
        name = "x" if problem.op == "fwd" else "dy"
        fmt = operands.lhs_format(problem)
        if fmt is None and problem.a_format != "bfloat16":
            reasons.append(
                Reason("dtype", f"grad_format None multiplies dy unquantized; dy is {problem.a_format}, needs bfloat16")
            )
        elif problem.a_format.startswith("mx_") and problem.a_format != f"mx_{fmt}":
            reasons.append(
                Reason("dtype", f"{name} is pre-quantized {problem.a_format[3:]}; recipe {problem.recipe} needs {fmt}")
            )
        if problem.b_format.startswith("mx_") and problem.b_format != "mx_e4m3":
            reasons.append(Reason("dtype", f"w is {problem.b_format[3:]}; mxfp8 weights are e4m3"))
        return reasons

    def run(self, problem: Problem, inputs: GroupedInputs) -> torch.Tensor:
        return calls.run(problem, inputs)

    def configs(self, problem: Problem) -> list[dict[str, int]]:
        """Kernel tiles for autotuning (``calls.configs``)."""
        return calls.configs(problem)

    def run_config(self, problem: Problem, inputs: GroupedInputs, config: dict[str, Any] | None) -> torch.Tensor:
        """``run`` with the tiles of one of ``configs(problem)`` (None: the defaults)."""
        return calls.run(problem, inputs, config)
