"""Per-call timings: CUDA events on a GPU, ``time.perf_counter`` on the CPU.

Equivalent to ``triton.testing.do_bench`` with rotated inputs instead of an L2 flush:
a warm-up sized in milliseconds, then one event pair around each call, and the median
of those. Calls run back to back, so when the host cannot keep the GPU busy (small
problems) the launch gap -- dispatch included -- is part of the time, as it is for a
user. ``fn(i)`` runs one call on operand set ``i``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

#: Calls timed to size the warm-up and the repetitions.
_PROBE_CALLS = 3


@dataclasses.dataclass(frozen=True)
class TimingPlan:
    """How long to warm up and to measure, in milliseconds of calls, and rep bounds.

    ``rounds`` splits the measurement of each contender into that many rounds, taken in
    turn with the other contenders (each round warms up again); the bounds and
    ``rep_ms`` are totals over the rounds.
    """

    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    min_reps: int = 5
    max_reps: int = 200
    rounds: int = 1

    def per_round(self) -> TimingPlan:
        """The plan of one round."""
        n = max(1, self.rounds)
        return TimingPlan(
            warmup_ms=self.warmup_ms,
            rep_ms=self.rep_ms / n,
            min_reps=max(1, -(-self.min_reps // n)),
            max_reps=max(1, self.max_reps // n),
        )


def _counts(plan: TimingPlan, estimate_ms: float) -> tuple[int, int]:
    per_call = max(estimate_ms, 1e-4)
    warmup = max(1, int(plan.warmup_ms / per_call))
    reps = min(plan.max_reps, max(plan.min_reps, int(plan.rep_ms / per_call)))
    return warmup, reps


def time_calls(fn: Callable[[int], object], sets: int, device: torch.device, plan: TimingPlan) -> list[float]:
    """Milliseconds of each timed call, in call order (take the median)."""
    if device.type == "cuda":
        return _time_cuda(fn, sets, plan)
    return _time_host(fn, sets, plan)


def _time_cuda(fn: Callable[[int], object], sets: int, plan: TimingPlan) -> list[float]:
    fn(0)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(_PROBE_CALLS):
        fn(i % sets)
    end.record()
    torch.cuda.synchronize()
    warmup, reps = _counts(plan, start.elapsed_time(end) / _PROBE_CALLS)
    for i in range(warmup):
        fn(i % sets)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn(i % sets)
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]


def _time_host(fn: Callable[[int], object], sets: int, plan: TimingPlan) -> list[float]:
    fn(0)
    t0 = time.perf_counter()
    for i in range(_PROBE_CALLS):
        fn(i % sets)
    warmup, reps = _counts(plan, (time.perf_counter() - t0) * 1e3 / _PROBE_CALLS)
    for i in range(warmup):
        fn(i % sets)
    times = []
    for i in range(reps):
        t = time.perf_counter()
        fn(i % sets)
        times.append((time.perf_counter() - t) * 1e3)
    return times


def median(times: list[float]) -> float:
    return statistics.median(times)
