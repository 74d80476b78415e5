"""How every Triton MX backend runs a call, whatever its recipe: the path follows the chip
(``tl.dot_scaled`` where ``Problem.device`` has MX block-scaled MMA, the register-upcast
kernel otherwise) and the operand formats follow the recipe (``operands``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from grouped_gemm import GroupedInputs, Problem
from grouped_gemm.backends.triton_mx import launch, operands
from grouped_gemm.recipes import get_recipe

#: What the shared kernels can run, whichever backend registers them: the paths (sm_90
#: upcast, dot_scaled on sm_100 / sm_103 / gfx950, Triton's interpreter on the CPU), MX
#: blocks of 32 along K (fwd) and N (dgrad), one tile-schedule entry per group in registers.
KERNEL_CAPABILITIES = {
    "ops": frozenset({"fwd", "dgrad", "wgrad"}),
    "vendors": frozenset({"cpu", "cuda", "rocm"}),
    "archs": ("cpu", "sm_90", "sm_100", "sm_103", "gfx950"),
    "dtypes": frozenset({"bfloat16", "float16", "float32"}),
    "out_dtypes": frozenset({"bfloat16", "float16", "float32"}),
    "n_multiple": 32,
    "k_multiple": 32,
    "min_k": 32,
    "max_groups": 1024,
    "host_splits": False,
    "accumulate": True,
    "weight_list": False,
    "non_contiguous": False,
    "deterministic": True,
}


def configs(problem: Problem) -> list[dict[str, int]]:
    """The kernel tiles autotuning may try for ``problem`` (the backends' ``configs`` hook):
    the candidates of the kernel its path runs (``launch.*_configs``), none where the
    sm_90 wgrad of a new bf16 result goes to ``torch._grouped_mm`` (the vendor route)."""
    scaled = problem.device.has("scaled_mma")
    if problem.op == "wgrad":
        vendor = not scaled and launch.vendor_wgrad_runs(problem)
        return [] if vendor else launch.offered(problem, launch.wgrad_configs())
    if scaled:
        return launch.offered(problem, launch.scaled_configs(problem.m, problem.groups))
    w_fmt = get_recipe(problem.recipe).weight_format
    return launch.offered(problem, launch.upcast_configs(problem.m, problem.groups, w_fmt))


def run(problem: Problem, inputs: GroupedInputs, config: Mapping[str, Any] | None = None) -> torch.Tensor:
    """The result of an eligible fwd, dgrad or wgrad call, written into ``inputs.out`` when
    given; ``config`` (one of ``configs(problem)``) picks the kernel's tiles, and is checked
    even where no kernel of it runs (no rows, the vendor wgrad route)."""
    if problem.op == "wgrad":
        return _wgrad(problem, inputs, launch.parse_config(launch.WgradConfig, config))
    scaled = problem.device.has("scaled_mma")
    scaled_tiles = launch.parse_config(launch.ScaledConfig, config) if scaled else None
    upcast_tiles = None if scaled else launch.parse_config(launch.UpcastConfig, config)
    name = "x" if problem.op == "fwd" else "dy"
    device = inputs.b.device
    out = inputs.output(problem)
    if problem.m == 0 or (problem.k if problem.op == "fwd" else problem.n) == 0:
        operands.activation(problem, inputs.a, name)  # an unfit MXTensor is refused all the same
        return out.zero_() if problem.m else out  # an empty contraction sums nothing
    splits = launch.device_splits(inputs.m_splits, device, inputs.capturing)
    if scaled:
        act = operands.activation(problem, inputs.a, name)
        w = operands.weight(problem, inputs.b)
        return launch.launch_scaled(act, w, splits, out, problem.groups, scaled_tiles)
    quantize = operands.activation_quantizer(problem, inputs.a)
    act = inputs.a if quantize else operands.decoded_activation(problem, inputs.a, name)
    w_up = operands.upcast_weight(problem, inputs.b)
    return launch.launch_upcast(act, w_up, splits, out, problem.groups, upcast_tiles, quantize)


def _wgrad(problem: Problem, inputs: GroupedInputs, tiles: launch.WgradConfig | None) -> torch.Tensor:
    """dy and x quantized along the tokens per group; ``tl.dot_scaled`` on them, or their exact
    bf16 decodes through the same wgrad kernel, or (sm_90, a new bf16 result) through
    ``torch._grouped_mm``."""
    if not problem.device.has("scaled_mma"):
        dy_b, x_b, ends = operands.wgrad_decoded(problem, inputs.a, inputs.b, inputs.m_splits)
        if inputs.out is None and launch.vendor_wgrad_runs(problem):
            return launch.vendor_wgrad(dy_b, x_b, ends)
        out = inputs.output(problem)
        return launch.launch_wgrad(dy_b, x_b, ends, out, problem.groups, problem.accumulate, tiles)
    dy_q, x_q, padded_ends = operands.wgrad_operands(problem, inputs.a, inputs.b, inputs.m_splits)
    out = inputs.output(problem)
    return launch.launch_wgrad(dy_q, x_q, padded_ends, out, problem.groups, problem.accumulate, tiles)
