"""The ``triton_mxfp4`` backend: what it declares, what it checks, and how it runs a call.

Path by chip (``Problem.device``): with MX block-scaled MMA (``DeviceInfo.has("scaled_mma")``:
gfx950, sm_100) the ``tl.dot_scaled`` kernel; otherwise (sm_90, and the CPU interpreter) the
upcast kernel, weights decoded to bf16 in registers, MX activations decoded to bf16 first.
"""

from __future__ import annotations

from typing import Any

import torch

from grouped_gemm import Backend, BackendSpec, GroupedInputs, Problem, Reason, __version__
from grouped_gemm.backends.triton_mx import calls, launch, operands


class TritonMxfp4Backend(Backend):
    """Persistent Triton grouped kernels for MXFP4 weights (a4w4, a8w4, a16w4)."""

    spec = BackendSpec(
        name="triton_mxfp4",
        version=f"{__version__}+{launch.UPCAST_REVISION}",
        description="persistent Triton MXFP4-weight grouped GEMM: dot_scaled (gfx950, sm_100), register upcast (sm_90)",
        recipes=frozenset({"mxfp4", "a8w4", "a16w4"}),
        mx_formats=frozenset({"e2m1", "e4m3"}),
        priority=80,
        **calls.KERNEL_CAPABILITIES,
    )

    def check(self, problem: Problem) -> list[Reason]:
        reasons = launch.placement_reasons(problem)
        if problem.op == "wgrad":
            reasons += _wgrad_reasons(problem)
        else:
            reasons += _lhs_reasons(problem)
            if problem.b_format.startswith("mx_") and problem.b_format != "mx_e2m1":
                reasons.append(Reason("dtype", f"w is {problem.b_format[3:]}; only e2m1 weights"))
        return reasons

    def run(self, problem: Problem, inputs: GroupedInputs) -> torch.Tensor:
        return calls.run(problem, inputs)

    def configs(self, problem: Problem) -> list[dict[str, int]]:
        """Kernel tiles for autotuning (``calls.configs``)."""
        return calls.configs(problem)

    def run_config(self, problem: Problem, inputs: GroupedInputs, config: dict[str, Any] | None) -> torch.Tensor:
        """``run`` with the tiles of one of ``configs(problem)`` (None: the defaults)."""
        return calls.run(problem, inputs, config)


#: Gradient formats each recipe's wgrad runs with (the kernel pairs them with x's format).
_WGRAD_GRAD_FORMATS = {"mxfp4": ("e2m1",), "a8w4": ("e4m3", "e5m2")}


def _lhs_reasons(problem: Problem) -> list[Reason]:
    """fwd's x / dgrad's dy: quantized per recipe, or already in the recipe's format."""
    name = "x" if problem.op == "fwd" else "dy"
    fmt = operands.lhs_format(problem)
    if fmt is None:
        if problem.a_format != "bfloat16":
            return [
                Reason(
                    "dtype",
                    f"{problem.recipe} {problem.op} multiplies {name} unquantized in bf16; "
                    f"{name} is {problem.a_format} (only bfloat16 is exact on this path)",
                )
            ]
        return []
    if fmt not in ("e2m1", "e4m3"):
        return [Reason("recipe", f"{name} format {fmt} (grad_format) not supported; e2m1 or e4m3")]
    if problem.a_format.startswith("mx_") and problem.a_format != f"mx_{fmt}":
        return [Reason("dtype", f"{name} is pre-quantized {problem.a_format[3:]}; recipe {problem.recipe} needs {fmt}")]
    return []


def _wgrad_reasons(problem: Problem) -> list[Reason]:
    """wgrad multiplies dy (grad_format) by x (the activation format): E2M1 x E2M1 for mxfp4,
    E4M3 x E4M3 for a8w4. a16w4 keeps both in bf16, a plain GEMM left to the bf16 backends."""
    reasons = []
    wanted = _WGRAD_GRAD_FORMATS.get(problem.recipe)
    if wanted is None:
        reasons.append(
            Reason(
                "recipe", f"wgrad of {problem.recipe} multiplies bf16 by bf16; this backend runs mxfp4 and a8w4 wgrad"
            )
        )
    elif problem.grad_format not in wanted:
        allowed = " or ".join(wanted)
        reasons.append(
            Reason("recipe", f"{problem.recipe} wgrad needs {allowed} gradients; grad_format is {problem.grad_format}")
        )
    if problem.a_format.startswith("mx_") or problem.b_format.startswith("mx_"):
        reasons.append(
            Reason("layout", "wgrad quantizes dy and x itself (per-group token blocks); pass high-precision tensors")
        )
    return reasons
