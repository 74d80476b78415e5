"""Per-call timings: CUDA events on a GPU, ``time.perf_counter`` on the CPU.

Equivalent to ``triton.testing.do_bench`` with rotated inputs instead of an L2 flush: a
warm-up, then one event pair around each call, and the median of those. The contenders
of one problem (backends and peer) are timed in blocks taken in turn over several
rounds, each block after its own warm-up, who goes first rotating per round. Seen on an
H200: one long block each puts the clock's step-down under load on whoever runs second
(+-10 % between two backends running the same kernel), and alternating single calls
puts the cost of following a launch-bound neighbour on the next one (up to 20 %).
Calls within a block run back to back, so when the host cannot keep the GPU busy the
launch gap -- dispatch included -- is part of the time, as it is for a user. The host's
own share is timed too: ``perf_counter`` around each timed call, no sync inside, is
what the call costs the host (dispatch and launches), however long the GPU takes.
``fn(i)`` runs one call on operand set ``i``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from grouped_gemm.clock import Clock
from grouped_gemm.errors import GroupedGemmError

#: What a failing contender may raise: the dispatcher wraps backend errors in
#: BackendRunError; torch raises RuntimeError (out-of-memory included) and friends.
CALL_ERRORS = (GroupedGemmError, RuntimeError, ValueError, TypeError)

#: Calls timed (per contender) to size the warm-up and the repetitions.
_PROBE_CALLS = 3

Call = Callable[[int], object]


@dataclasses.dataclass(frozen=True)
class TimingPlan:
    """Per contender: ``warmup_ms`` of calls before its first block (a quarter of it before
    the others), ``rep_ms`` of timed calls in all, split over ``rounds`` blocks, and
    bounds on the number of timed calls in all; on a GPU, ``soak_ms`` of untimed calls of
    every contender in turn before the first block (``time_in_rounds``)."""

    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    min_reps: int = 5
    max_reps: int = 200
    rounds: int = 1
    soak_ms: float = 300.0

    def block(self, per_call_ms: float, first: bool) -> tuple[int, int]:
        """(warm-up calls, timed calls) of one block for a call of ``per_call_ms``."""
        per_call = max(per_call_ms, 1e-4)
        rounds = max(1, self.rounds)
        warmup = max(1, int((self.warmup_ms if first else self.warmup_ms / 4) / per_call))
        reps = int(self.rep_ms / rounds / per_call)
        return warmup, min(max(1, self.max_reps // rounds), max(-(-self.min_reps // rounds), reps))


@dataclasses.dataclass
class Timed:
    """One contender's timed calls (ms, in call order), each round's median and the host
    time of each timed call (us), or the exception it raised."""

    times_ms: list[float] = dataclasses.field(default_factory=list)
    round_medians_ms: list[float] = dataclasses.field(default_factory=list)
    host_us: list[float] = dataclasses.field(default_factory=list)
    error: Exception | None = None


def time_in_rounds(calls: list[Call], sets: list[int], device: torch.device, plan: TimingPlan) -> list[Timed]:
    """Time each contender in ``plan.rounds`` blocks, the contenders taking turns.

    Contender ``j`` starts its operand sets at ``j * (sets // n)`` so that one contender
    does not read what the previous one left in cache. Before anything is timed each
    contender runs once on every set (what a call builds once per operand, such as a
    pre-quantized weight's layout, is then not in the first contender's estimate), and on
    a GPU the contenders run in turn untimed for ``plan.soak_ms``, so that the first blocks
    start on a GPU already under load, as the later ones do (the clock's step-down under
    load, above). Round ``r`` starts at contender
    ``r * n // rounds``, spreading who goes first and last evenly (moving by one a round,
    three rounds of ten contenders put some mostly early and others mostly late).
    """
    clock = Clock(device.type == "cuda")
    n = len(calls)
    out = [Timed() for _ in calls]
    offsets = [j * max(1, sets[j] // n) for j in range(n)]
    estimates: dict[int, float] = {}
    for j in range(n):
        try:
            for i in range(sets[j]):
                calls[j](i)
            clock.sync()
            start = clock.stamp()
            for i in range(_PROBE_CALLS):
                calls[j]((offsets[j] + i) % sets[j])
            end = clock.stamp()
            clock.sync()
            estimates[j] = clock.ms(start, end) / _PROBE_CALLS
        except CALL_ERRORS as exc:  # reported per contender; the others go on
            out[j].error = exc
    _soak(calls, [j for j in estimates if out[j].error is None], clock, plan.soak_ms, out)
    rounds = max(1, plan.rounds)
    for r in range(rounds):
        live = [j for j in estimates if out[j].error is None]
        if not live:
            break
        first = r * len(live) // rounds
        for j in live[first:] + live[:first]:
            warmup, reps = plan.block(estimates[j], first=r == 0)
            stamps, host = [], []
            try:
                for i in range(warmup + reps):
                    start = clock.stamp()
                    began = time.perf_counter()
                    calls[j]((offsets[j] + i) % sets[j])
                    spent = time.perf_counter() - began
                    end = clock.stamp()
                    if i >= warmup:
                        stamps.append((start, end))
                        host.append(spent * 1e6)
                clock.sync()
            except CALL_ERRORS as exc:  # reported per contender; the others go on
                out[j].error = exc
                continue
            times = [clock.ms(s, e) for s, e in stamps]
            out[j].times_ms += times
            out[j].host_us += host
            out[j].round_medians_ms.append(statistics.median(times))
    return out


def _soak(calls: list[Call], live: list[int], clock: Clock, soak_ms: float, out: list[Timed]) -> None:
    """On a GPU, the ``live`` contenders in turn, untimed, until ``soak_ms`` have passed."""
    if not clock.cuda or soak_ms <= 0 or not live:
        return
    began = time.perf_counter()
    while (time.perf_counter() - began) * 1e3 < soak_ms:
        for j in live:
            if out[j].error is None:
                try:
                    calls[j](0)
                except CALL_ERRORS as exc:  # reported per contender; the others go on
                    out[j].error = exc
        clock.sync()
        if all(out[j].error is not None for j in live):
            return


def time_calls(fn: Call, sets: int, device: torch.device, plan: TimingPlan) -> list[float]:
    """Milliseconds of each timed call of one function (its exception propagates)."""
    timed = time_in_rounds([fn], [sets], device, plan)[0]
    if timed.error is not None:
        raise timed.error
    return timed.times_ms


def back_to_back_ms(fn: Callable[[], object], calls: int) -> float:
    """Per-call ms of ``calls`` back-to-back calls of ``fn`` between one pair of CUDA events:
    a stream of launches timed as a whole (a graph replay, a kernel A/B), where
    ``time_in_rounds``'s event pair around each call would time each launch alone."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def median(times: list[float]) -> float:
    return statistics.median(times)
