"""Backend ``reference``: one torch matmul per group in fp32, the ground truth.

Runs every op on any device, slowly: each group's operands are upcast to fp32, multiplied
(fp32 accumulation), and the result cast to the output dtype. When torch is allowed to
use TF32 for fp32 matmuls, it computes in float64 instead, so it stays exact.
"""

from __future__ import annotations

import torch

from grouped_gemm import Backend, BackendSpec, GroupedInputs, Problem, __version__, hookimpl

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _accumulate_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        return torch.float64
    return torch.float32


class ReferenceBackend(Backend):
    """Per-group fp32 torch matmuls; host splits (one sync if they are on the device)."""

    spec = BackendSpec(
        name="reference",
        version=__version__,
        description="per-group fp32 torch matmul; the ground truth, slow",
        ops=frozenset({"fwd", "dgrad", "wgrad"}),
        recipes=frozenset({"bf16", "fp16", "fp32"}),
        vendors=frozenset({"cpu", "cuda", "rocm"}),
        host_splits=True,
        weight_list=True,
        priority=0,
    )

    def run(self, problem: Problem, inputs: GroupedInputs) -> torch.Tensor | list[torch.Tensor]:
        splits = inputs.splits_list()
        if problem.op == "wgrad":
            return self._wgrad(problem, inputs, splits)
        a, w = inputs.a, inputs.b
        cols = problem.n if problem.op == "fwd" else problem.k
        out = inputs.out
        if out is None:
            out = torch.empty(problem.m, cols, dtype=_DTYPES[problem.out_dtype], device=a.device)
        acc = _accumulate_dtype(a.device)
        start = 0
        for g, rows in enumerate(splits):
            if rows:
                w_g = w[g].to(acc)
                a_g = a[start : start + rows].to(acc)
                out[start : start + rows] = a_g @ (w_g.T if problem.op == "fwd" else w_g)
            start += rows
        return out

    def _wgrad(self, problem: Problem, inputs: GroupedInputs, splits: list[int]) -> torch.Tensor | list[torch.Tensor]:
        dy, x = inputs.a, inputs.b
        out = inputs.out
        if out is None:
            out = torch.empty(problem.groups, problem.n, problem.k, dtype=_DTYPES[problem.out_dtype], device=dy.device)
        acc = _accumulate_dtype(dy.device)
        start = 0
        for g, rows in enumerate(splits):
            target = out[g]
            if rows:
                grad = dy[start : start + rows].to(acc).T @ x[start : start + rows].to(acc)
                if problem.accumulate:
                    grad += target.to(acc)
                target.copy_(grad)
            elif not problem.accumulate:
                target.zero_()
            start += rows
        return out


@hookimpl
def grouped_gemm_backends() -> list[Backend]:
    return [ReferenceBackend()]
