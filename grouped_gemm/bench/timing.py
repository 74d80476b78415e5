"""Per-call timings: CUDA events on a GPU, ``time.perf_counter`` on the CPU.

Equivalent to ``triton.testing.do_bench`` with rotated inputs instead of an L2 flush: a
warm-up sized in milliseconds, then one event pair around each call, and the median of
those. The contenders of one problem (backends and peer) are timed call by call in turn
(A, B, C, A, B, C, ...): an H200's clock steps down within a fraction of a second of
heavy load, and back-to-back blocks of calls put that step on whoever ran second (seen
here as +-10 % between two backends running the same kernel). Calls run back to back, so
when the host cannot keep the GPU busy the launch gap -- dispatch included -- is part of
the time, as it is for a user. ``fn(i)`` runs one call on operand set ``i``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from grouped_gemm.errors import GroupedGemmError

#: What a failing contender may raise: the dispatcher wraps backend errors in
#: BackendRunError; torch raises RuntimeError (out-of-memory included) and friends.
CALL_ERRORS = (GroupedGemmError, RuntimeError, ValueError, TypeError)

#: Calls timed (per contender) to size the warm-up and the repetitions.
_PROBE_CALLS = 3

Call = Callable[[int], object]


@dataclasses.dataclass(frozen=True)
class TimingPlan:
    """Warm-up and measurement per contender, in milliseconds of its calls, and bounds
    on the number of timed calls."""

    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    min_reps: int = 5
    max_reps: int = 200


def _counts(plan: TimingPlan, per_call_ms: float) -> tuple[int, int]:
    """(warm-up iterations, timed iterations) when one iteration costs ``per_call_ms``
    per contender on average."""
    per_call = max(per_call_ms, 1e-4)
    warmup = max(1, int(plan.warmup_ms / per_call))
    reps = min(plan.max_reps, max(plan.min_reps, int(plan.rep_ms / per_call)))
    return warmup, reps


class _Clock:
    """Start/stop stamps of one call: CUDA events, or the host clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def stamp(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, start: object, end: object) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3


def time_interleaved(
    calls: list[Call], sets: list[int], device: torch.device, plan: TimingPlan
) -> list[list[float] | Exception]:
    """Milliseconds of each timed call of each contender, or the exception it raised.

    Contender ``j`` uses operand set ``(i + j * stride) % sets[j]`` in iteration ``i``,
    staggered so that one contender does not read what the previous one left in cache.
    """
    clock = _Clock(device)
    n = len(calls)
    results: list[list[float] | Exception] = [[] for _ in calls]

    def run(j: int, i: int) -> None:
        calls[j]((i + j * max(1, sets[j] // n)) % sets[j])

    estimates = {}
    for j in range(n):
        try:
            run(j, 0)
            clock.sync()
            start = clock.stamp()
            for i in range(_PROBE_CALLS):
                run(j, i)
            end = clock.stamp()
            clock.sync()
            estimates[j] = clock.ms(start, end) / _PROBE_CALLS
        except CALL_ERRORS as exc:  # reported per contender; the others go on
            results[j] = exc
    alive = list(estimates)
    if not alive:
        return results
    warmup, reps = _counts(plan, sum(estimates.values()) / len(alive))
    stamps: dict[int, list[tuple[object, object]]] = {j: [] for j in alive}
    for i in range(warmup + reps):
        for j in list(alive):
            try:
                start = clock.stamp()
                run(j, i)
                end = clock.stamp()
            except CALL_ERRORS as exc:  # reported per contender; the others go on
                results[j] = exc
                alive.remove(j)
                continue
            if i >= warmup:
                stamps[j].append((start, end))
    clock.sync()
    for j in alive:
        results[j] = [clock.ms(s, e) for s, e in stamps[j]]
    return results


def time_calls(fn: Call, sets: int, device: torch.device, plan: TimingPlan) -> list[float]:
    """Milliseconds of each timed call of one function (its exception propagates)."""
    result = time_interleaved([fn], [sets], device, plan)[0]
    if isinstance(result, Exception):
        raise result
    return result


def median(times: list[float]) -> float:
    return statistics.median(times)
