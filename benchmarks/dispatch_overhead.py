"""Dispatch overhead: a cached ``gg.grouped_gemm`` call vs the same backend's ``run``.

Tiny CPU tensors and list splits, so the backend's own work is small and the difference
is what the library adds per call (validation, Problem lookup, cached decision, stats).
Batches of calls alternate between the two paths; the figure is the median over batches
of the per-call difference. Two backends are measured: ``reference`` (what the issue
asks) and ``noop`` (a registered backend that returns a preallocated tensor), whose
near-zero run time makes the overhead stand out from timing noise.

    python benchmarks/dispatch_overhead.py [--batches 200] [--calls 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import grouped_gemm as gg
from grouped_gemm import validation
from grouped_gemm.registry import registry


class NoopBackend(gg.Backend):
    """Returns a preallocated output of the right shape (the core checks it): measures
    everything but the math."""

    spec = gg.BackendSpec(
        name="noop_overhead_probe",
        ops=frozenset({"fwd"}),
        recipes=frozenset({"fp32"}),
        vendors=frozenset({"cpu"}),
        weight_list=True,
        priority=-1,
    )

    def __init__(self) -> None:
        self.outs: dict[tuple[int, int], torch.Tensor] = {}

    def run(self, problem: gg.Problem, inputs: gg.GroupedInputs) -> torch.Tensor:
        out = self.outs.get((problem.m, problem.n))
        if out is None:
            out = self.outs[(problem.m, problem.n)] = torch.empty(problem.m, problem.n)
        return out


def _per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def measure(groups: int, backend: str, batches: int, calls: int) -> tuple[float, float, float]:
    """(median api us, median direct us, median extra us) for one backend and G."""
    x = torch.randn(2 * groups, 8)
    w = torch.randn(groups, 8, 8)
    splits = [2] * groups
    direct_backend = registry().get(backend).backend
    problem = validation.fwd_or_dgrad("fwd", x, w, splits, None, None, None).problem()

    def api() -> None:
        gg.grouped_gemm(x, w, splits, backend=backend)

    def direct() -> None:
        direct_backend.run(problem, gg.GroupedInputs(x, w, splits))

    for _ in range(3):
        api()
        direct()
    api_t, direct_t, extra = [], [], []
    for _ in range(batches):
        a = _per_call(api, calls)
        d = _per_call(direct, calls)
        api_t.append(a)
        direct_t.append(d)
        extra.append(a - d)
    us = 1e6
    return statistics.median(api_t) * us, statistics.median(direct_t) * us, statistics.median(extra) * us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    gg.register_backend(NoopBackend())
    print(f"torch {torch.__version__}, grouped_gemm {gg.__version__}, {torch.get_num_threads()} threads")
    print(f"{'backend':<22}{'G':>5}{'api us':>10}{'run us':>10}{'extra us':>10}")
    for backend in ("noop_overhead_probe", "reference"):
        for groups in (8, 128):
            calls = args.calls if backend != "reference" else max(args.calls // 10, 5)
            api, direct, extra = measure(groups, backend, args.batches, calls)
            print(f"{backend:<22}{groups:>5}{api:>10.2f}{direct:>10.2f}{extra:>10.2f}")


if __name__ == "__main__":
    main()
