"""``padded_bmm``: a grouped_gemm backend plugin that pads groups and runs one bmm.

Registered through the ``grouped_gemm`` entry-point group. Every op becomes one
``torch.bmm`` over a ``(G, capacity, ...)`` padded copy of the activations; rows are
gathered in and out with indices computed on the device, so with device splits and a
configured capacity nothing syncs and the call can be captured in a CUDA graph.
"""

from __future__ import annotations

import os

import torch

import grouped_gemm as gg

CAPACITY_ENV = "GROUPED_GEMM_PADDED_BMM_CAPACITY"
#: Padded rows (G x the largest group, as ``Problem.max_rows`` bounds it) may be at most
#: this many times M (declared as ``max_padding``; the core refuses the rest). Balanced
#: splits stay under it even with ``max_rows`` rounded up to a power of two (at most 2x);
#: one large group among many (G=16: up to 16x) does not.
MAX_PADDING = 4.0
#: On CPU a padded bmm computes and copies the padding that ``torch._grouped_mm`` (priority
#: 5 there) skips, so it ranks below it; elsewhere ``spec.priority`` applies.
CPU_PRIORITY = 2


def configured_capacity() -> int | None:
    """Rows per group for device splits, from ``GROUPED_GEMM_PADDED_BMM_CAPACITY``."""
    raw = os.environ.get(CAPACITY_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise gg.ConfigError(CAPACITY_ENV, raw, "a positive integer (rows per group)")
    return int(raw)


def _row_map(inputs: gg.GroupedInputs, rows: int, capacity: int, device: torch.device) -> torch.Tensor:
    """For each of the M rows, its index in the flattened ``(G * capacity)`` padded layout."""
    ends = inputs.offsets(device, torch.int64)
    row = torch.arange(rows, device=device)
    group = torch.searchsorted(ends, row, right=True)
    begin = torch.cat([ends.new_zeros(1), ends[:-1]])
    return group * capacity + (row - begin[group])


class PaddedBmmBackend(gg.Backend):
    """One batched matmul over groups padded to a common row count."""

    spec = gg.BackendSpec(
        name="padded_bmm",
        version="0.1.0",
        description="pads groups to one size, one torch.bmm; few near-balanced groups",
        ops=frozenset({"fwd", "dgrad", "wgrad"}),
        recipes=frozenset({"bf16", "fp16", "fp32"}),
        vendors=frozenset({"cpu", "cuda", "rocm"}),
        max_groups=16,
        max_padding=MAX_PADDING,
        priority=10,
    )

    def check(self, problem: gg.Problem) -> list[gg.Reason]:
        if not problem.host_splits and configured_capacity() is None:
            return [
                gg.Reason(
                    "config",
                    f"m_splits are on the device: set {CAPACITY_ENV} (rows per group) to pad without a host sync",
                )
            ]
        return []

    def priority(self, problem: gg.Problem) -> int:
        return CPU_PRIORITY if problem.device.vendor == "cpu" else self.spec.priority

    def run(self, problem: gg.Problem, inputs: gg.GroupedInputs) -> torch.Tensor:
        a = inputs.a
        device = a.device
        if problem.host_splits:
            capacity = max(inputs.splits_list())
        else:
            capacity = configured_capacity()
            torch._assert_async(
                (inputs.m_splits <= capacity).all(), f"padded_bmm: a group exceeds {CAPACITY_ENV}={capacity}"
            )
        index = _row_map(inputs, problem.m, capacity, device)
        groups = problem.groups

        out_dtype = problem.out_torch_dtype
        # A result in another dtype than the inputs' (an fp32 main_grad, fp16 from bf16) is
        # computed in fp32: in the input dtype it would carry that dtype's rounding, or its
        # range (fp16 sums past 65504 are inf, also in a bf16 output that holds them).
        compute = a.dtype if out_dtype == a.dtype else torch.float32

        def padded(t: torch.Tensor) -> torch.Tensor:
            buf = t.new_zeros(groups * capacity, t.shape[1], dtype=compute)
            buf.index_copy_(0, index, t.to(compute))
            return buf.view(groups, capacity, t.shape[1])

        if problem.op == "wgrad":
            grad = torch.bmm(padded(a).transpose(1, 2), padded(inputs.b))
            out = inputs.out
            if out is None:
                return grad.to(out_dtype)
            if problem.accumulate:
                out.add_(grad.to(out.dtype))
            else:
                out.copy_(grad)
            return out
        w = inputs.b.to(compute)
        rhs = w.transpose(1, 2) if problem.op == "fwd" else w
        result = torch.bmm(padded(a), rhs).view(groups * capacity, problem.out_shape[1]).index_select(0, index)
        return result.to(out_dtype)


@gg.hookimpl
def grouped_gemm_backends() -> list[gg.Backend]:
    return [PaddedBmmBackend()]
