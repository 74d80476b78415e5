"""Autotuning: fastest wins, close calls are timed again interleaved, ties go to priority,
wrong or raising backends are excluded, user orders win, nothing is measured under capture
or compile, choices persist."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm import autotune, cli, testing, tuning_store, validation
from grouped_gemm.bench import tune
from grouped_gemm.device import emulated
from grouped_gemm.dispatch import DISPATCHER
from grouped_gemm.registry import registry
from grouped_gemm.tuning_store import AutotuneCacheWarning, CloseCall, Timing, Tuning

HERE = Path(__file__).resolve().parent
# The fakes live in a script of their own, which a test also runs in fresh processes.
_spec = importlib.util.spec_from_file_location("autotune_fakes", HERE / "autotune_fakes.py")
_fakes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fakes)
TimedBackend = _fakes.TimedBackend
FakeClock = _fakes.FakeClock
SPLITS = [16, 0, 37, 11]  # an empty group, unaligned sizes


@pytest.fixture
def only(monkeypatch, tmp_path):
    """Replace every registered backend by the test's fakes, with a private cache
    directory, short timing plans and one torch thread (OpenMP wake-ups after a sleep
    cost tens of ms on a loaded machine)."""
    monkeypatch.setenv(tuning_store.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.setattr(autotune, "PLAN", autotune.Plan(warmup_ms=2, rep_ms=9, min_reps=3, max_reps=30))
    monkeypatch.setattr(autotune, "CLOSE_PLAN", autotune.ClosePlan(rep_ms=20, min_blocks=4, max_blocks=10))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with _fakes.only_registered() as add:
        yield add
    torch.set_num_threads(threads)


def _operands(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(sum(SPLITS), 32, generator=gen), torch.randn(len(SPLITS), 24, 32, generator=gen)


def _check_fwd(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    assert testing.rel_error(y, testing.ref_fwd(x, w, SPLITS)) < 1e-5


def test_fastest_backend_is_chosen_and_reused(only, gen):
    slow, fast = TimedBackend("slow", delay=0.006, priority=100), TimedBackend("fast", delay=0.0005)
    only(slow, fast)
    x, w = _operands(gen)
    gg.configure(autotune=True)
    out = testing.poison(torch.empty(sum(SPLITS), 24))
    y = gg.grouped_gemm(x, w, SPLITS, out=out)
    assert y is out
    _check_fwd(y, x, w)
    stats = gg.dispatch_stats()
    assert stats["selected"] == {"fast": 1}
    assert stats["autotune"]["tuned"] == 1 and stats["autotune"]["calls"] > 2
    decision = gg.explain(x, w, SPLITS)
    assert decision.order_source == "autotune" and decision.selected == "fast"
    assert decision.tuning.priority_choice == "slow" and decision.tuning.choice == "fast"
    times = {t.backend: t for t in decision.tuning.timings}
    assert times["fast"].ms < times["slow"].ms
    table = decision.table()
    assert "order:   autotune" in table and "declared priority would pick slow" in table
    runs = fast.runs
    for _ in range(3):
        _check_fwd(gg.grouped_gemm(x, w, SPLITS), x, w)
    assert fast.runs == runs + 3  # no more measuring: exactly one run per call
    assert gg.dispatch_stats()["autotune"]["tuned"] == 1


def test_a_backend_unregistered_before_the_measurement_is_left_out(only, gen, monkeypatch):
    """Another thread may unregister a backend between the decision that made it a
    contender and the measurement: it is left out with a note, and the call runs on the
    others (it raised UnknownBackendError for a name the call never passed)."""
    gone, kept = TimedBackend("gone", delay=0.0005, priority=100), TimedBackend("kept", delay=0.001)
    only(gone, kept)
    measure = autotune.TUNER.measure

    def unregister_first(*args, **kwargs):
        if "gone" in registry().names():
            registry().unregister("gone")
        return measure(*args, **kwargs)

    monkeypatch.setattr(autotune.TUNER, "measure", unregister_first)
    x, w = _operands(gen)
    gg.configure(autotune=True)
    _check_fwd(gg.grouped_gemm(x, w, SPLITS), x, w)
    assert gg.dispatch_stats()["selected"] == {"kept": 1} and gone.runs == 0
    assert not autotune.TUNER._offers_configs("gone")


class _SkewSensitive(TimedBackend):
    """Fast on one kind of split only: ``fast_when_skewed`` says which (skew read from
    ``Problem.max_rows``, the largest group as a power of two)."""

    def __init__(self, name: str, *, fast_when_skewed: bool) -> None:
        super().__init__(name)
        self.fast_when_skewed = fast_when_skewed

    def run(self, problem: gg.Problem, inputs: gg.GroupedInputs) -> torch.Tensor:
        self.runs += 1
        skewed = problem.max_rows * problem.groups > 2 * problem.m
        return self._compute(problem, inputs, 0.0005 if skewed == self.fast_when_skewed else 0.004)


def test_host_splits_of_one_shape_are_tuned_apart_when_one_is_skewed(only, gen):
    """Balanced and skewed host splits of the same M bucket get their own measurement and
    their own choice; every later call of either reuses its own."""
    flat = _SkewSensitive("flat", fast_when_skewed=False)
    peaky = _SkewSensitive("peaky", fast_when_skewed=True)
    only(flat, peaky)
    balanced, skewed = [16, 16, 16, 16], [61, 1, 0, 2]
    x = torch.randn(64, 32, generator=gen)
    w = torch.randn(4, 24, 32, generator=gen)
    gg.configure(autotune=True)
    for splits, chosen in ((balanced, "flat"), (skewed, "peaky"), (balanced, "flat"), (skewed, "peaky")):
        y = gg.grouped_gemm(x, w, splits)
        assert testing.rel_error(y, testing.ref_fwd(x, w, splits)) < 1e-5
        decision = gg.explain(x, w, splits)
        assert decision.selected == chosen, (splits, decision.table())
    assert gg.dispatch_stats()["autotune"]["tuned"] == 2
    keys = {autotune.tuning_key(gg.explain(x, w, s).problem) for s in (balanced, skewed)}
    assert len(keys) == 2 and all("max_rows=" in k for k in keys)


def test_choose_breaks_ties_by_declared_rank():
    rank = {"a": 0, "b": 1, "c": 2}
    t = [Timing("a", None, 1.01, 5), Timing("b", None, 1.0, 5), Timing("c", None, 0.5, 5, "pruned: probe")]
    assert autotune.choose(t, rank).backend == "a"  # within 2 %: declared rank
    assert autotune.choose(t, rank, margin=0.0).backend == "b"
    t[0] = Timing("a", None, 1.03, 5)
    assert autotune.choose(t, rank).backend == "b"  # beyond the margin: the fastest
    assert autotune.choose([Timing("a", None, None, 0, "raised")], rank) is None
    configs = [Timing("a", None, 2.0, 5), Timing("a", {"t": 1}, 1.0, 5), Timing("a", {"t": 2}, 1.0, 5)]
    assert autotune.choose(configs, {"a": 0}).config == {"t": 1}


def test_a_close_call_is_timed_again_interleaved_and_the_faster_wins(only, gen, monkeypatch):
    # A clock swinging +-8 % over 30 ms: the rotating rounds see "slower" (4 % slower,
    # declared first) as the faster one; paired ratios of interleaved blocks do not.
    clock = FakeClock(swing=0.08, period_s=0.03, phase=0.75)
    monkeypatch.setattr(autotune, "Clock", clock)
    slower = TimedBackend("slower", delay=0.00104, priority=10, clock=clock)
    faster = TimedBackend("faster", delay=0.001, clock=clock)
    only(slower, faster)
    x, w = _operands(gen)
    gg.configure(autotune=True)
    _check_fwd(gg.grouped_gemm(x, w, SPLITS), x, w)
    decision = gg.explain(x, w, SPLITS)
    assert decision.selected == "faster" and decision.tuning.priority_choice == "slower"
    close = decision.tuning.close_call
    assert set(close.labels) == {"slower", "faster"} and close.margin == autotune.CLOSE_MARGIN
    rounds = [Timing(label, None, ms, 1) for label, ms in zip(close.labels, close.rounds_ms, strict=True)]
    assert autotune.choose(rounds, {"slower": 0, "faster": 1}).backend == "slower"  # the rounds alone: wrong
    times = {t.backend: t.ms for t in decision.tuning.timings}
    assert times["slower"] / times["faster"] == pytest.approx(1.04, abs=0.01)
    # ClosePlan(rep_ms=20) at ~1 ms a call: 10 blocks of 1 untimed + 2 timed calls each
    assert close.calls == 2 * 10 * 3
    stats = gg.dispatch_stats()["autotune"]
    assert stats["close_calls"] == 1
    assert stats["calls"] == slower.runs + faster.runs - 1  # all but the real call, the extra ones included
    assert "close call: " in decision.table() and f"+{close.calls} calls" in decision.table()
    assert tune.times_cell(decision.tuning).endswith(f"(close call +{close.calls} calls)")
    _, stored = tuning_store.read_any(autotune.TUNER.file_for(decision.problem.device))
    assert stored[decision.tuning.key].close_call == close and isinstance(close, CloseCall)


def test_a_close_call_keeps_the_rounds_scale(only, gen, monkeypatch):
    """Blocks that time every contender longer (each starts after a device sync) must not
    hand the win to a contender timed in the rounds only: on an H100 the close call's
    2.84 ms against a bystander's 2.69 ms round median picked the bystander, 17 % slower
    in the rounds (qwen3_235b_gateup bf16 fwd)."""
    clock = FakeClock()
    monkeypatch.setattr(autotune, "Clock", clock)
    interleave = autotune.interleave

    def slow_blocks(*args, **kwargs):
        blocks, made = interleave(*args, **kwargs)
        return [[[1.3 * ms for ms in block] for block in per] for per in blocks], made

    monkeypatch.setattr(autotune, "interleave", slow_blocks)
    first = TimedBackend("first", delay=0.001, clock=clock)
    second = TimedBackend("second", delay=0.00103, clock=clock)
    bystander = TimedBackend("bystander", delay=0.0012, priority=10, clock=clock)  # beyond CLOSE_MARGIN
    only(first, second, bystander)
    x, w = _operands(gen)
    gg.configure(autotune=True)
    _check_fwd(gg.grouped_gemm(x, w, SPLITS), x, w)
    decision = gg.explain(x, w, SPLITS)
    assert set(decision.tuning.close_call.labels) == {"first", "second"}
    assert decision.selected == "first", decision.table()
    times = {t.backend: t.ms for t in decision.tuning.timings}
    assert times["first"] == pytest.approx(1.0, rel=1e-6)  # its round median, not 1.3
    assert times["second"] == pytest.approx(1.03, rel=1e-3)
    assert times["bystander"] == pytest.approx(1.2, rel=1e-6)


def test_paired_ms_scales_from_the_given_base():
    blocks = [[[2.0, 2.0], [2.0, 2.0]], [[2.2, 2.2], [2.2, 2.2]]]
    assert autotune.paired_ms(blocks) == pytest.approx([2.0, 2.2])
    assert autotune.paired_ms(blocks, 1.5) == pytest.approx([1.5, 1.65])


class _Jittery(TimedBackend):
    """``delay`` on average, but 6 % slower or faster in runs of ``period`` calls: a lead
    of 1 % over a steady neighbour flips from block pair to block pair."""

    def __init__(self, name: str, *, delay: float, clock: FakeClock, period: int) -> None:
        super().__init__(name, delay=delay, clock=clock)
        self.period = period

    def run(self, problem: gg.Problem, inputs: gg.GroupedInputs) -> torch.Tensor:
        self.runs += 1
        jitter = 0.06 if (self.runs // self.period) % 2 else -0.06
        return self._compute(problem, inputs, self.delay * (1.0 + jitter))


def test_a_lead_that_flips_between_block_pairs_is_a_tie_for_priority(only, gen, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(autotune, "Clock", clock)
    steady = TimedBackend("steady", delay=0.001, priority=10, clock=clock)
    jittery = _Jittery("jittery", delay=0.00099, clock=clock, period=6)
    only(steady, jittery)
    x, w = _operands(gen)
    gg.configure(autotune=True)
    _check_fwd(gg.grouped_gemm(x, w, SPLITS), x, w)
    decision = gg.explain(x, w, SPLITS)
    close = decision.tuning.close_call
    assert close is not None and set(close.ties) == {"steady", "jittery"}
    assert decision.selected == "steady" and "a tie: " in decision.table()


def test_pair_wins_counts_block_pairs_with_drift_cancelled():
    ref = [[1.0, 1.0]] * 4
    # 3 % faster, under a drift of 5 % that alternates with the A B / B A order
    mine = [[0.97 * 1.05] * 2, [0.97 / 1.05] * 2, [0.97 * 1.05] * 2, [0.97 / 1.05] * 2]
    assert autotune.pair_wins(mine, ref) == 1.0
    flips = [[0.95] * 2, [0.95] * 2, [1.05] * 2, [1.05] * 2]  # a lead in one pair, behind in the other
    assert autotune.pair_wins(flips, ref) == 0.5
    assert autotune.pair_wins([[0.9]], [[1.0]]) == 0.0  # no full pair: no evidence
    rank = {"a": 0, "b": 1}
    timings = [Timing("a", None, 1.05, 5), Timing("b", None, 1.0, 5)]
    assert autotune.choose(timings, rank).backend == "b"
    assert autotune.choose(timings, rank, close=CloseCall(("b", "a"), (1.0, 1.05), 0.1, 8, ("a", "b"))).backend == "a"


def test_a_consistent_close_call_winner_is_not_tied_away():
    rank = {"a": 0, "b": 1, "c": 2}
    timings = [Timing("a", None, 1.015, 5), Timing("b", None, 1.0, 5), Timing("c", None, 1.01, 5)]
    assert autotune.choose(timings, rank).backend == "a"  # no close call: within 2 %, declared rank
    beat_a = CloseCall(("b", "a"), (1.0, 1.03), 0.1, 8)  # b won the block pairs: no ties
    assert autotune.choose(timings, rank, close=beat_a).backend == "b"
    flipped = CloseCall(("b", "a"), (1.0, 1.03), 0.1, 8, ("a", "b"))
    assert autotune.choose(timings, rank, close=flipped).backend == "a"
    only_c = CloseCall(("c", "a"), (1.0, 1.03), 0.1, 8)  # b not in the close call: the margin rules
    assert autotune.choose(timings, rank, close=only_c).backend == "a"
    small_lead = [Timing("a", None, 1.009, 5), Timing("b", None, 1.0, 5)]  # under half the margin: a tie
    assert autotune.choose(small_lead, rank, close=beat_a).backend == "a"


def test_a_small_steady_lead_wins_its_close_call(only, gen, monkeypatch):
    # 1.5 % apart, inside the tie margin but over half of it, ahead in every block pair: not a tie.
    clock = FakeClock()
    monkeypatch.setattr(autotune, "Clock", clock)
    first = TimedBackend("first", delay=0.001015, priority=10, clock=clock)
    only(first, TimedBackend("ahead", delay=0.001, clock=clock))
    x, w = _operands(gen)
    gg.configure(autotune=True)
    _check_fwd(gg.grouped_gemm(x, w, SPLITS), x, w)
    decision = gg.explain(x, w, SPLITS)
    assert decision.tuning.close_call is not None and decision.tuning.close_call.ties == ()
    assert decision.selected == "ahead" and decision.tuning.priority_choice == "first", decision.table()


def test_a_clear_case_takes_no_extra_calls(only, gen, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(autotune, "Clock", clock)
    slow, fast = (
        TimedBackend("slow", delay=0.0016, priority=10, clock=clock),
        TimedBackend("fast", delay=0.0011, clock=clock),
    )
    only(slow, fast)
    x, w = _operands(gen)
    gg.configure(autotune=True)
    gg.grouped_gemm(x, w, SPLITS)
    decision = gg.explain(x, w, SPLITS)
    assert decision.selected == "fast" and decision.tuning.close_call is None
    # per contender: 1 agreement run, 3 probes, then 3 rounds of (warm-up, timed) calls:
    # fast (2, 2), (1, 2), (1, 2); slow (2, 1), (1, 1), (1, 1)
    assert (fast.runs - 1, slow.runs) == (14, 11)
    assert gg.dispatch_stats()["autotune"] == {**gg.dispatch_stats()["autotune"], "close_calls": 0, "calls": 25}
    assert "close call" not in decision.table()


def test_close_contenders_beyond_the_cap_are_pruned(only, gen, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(autotune, "Clock", clock)
    monkeypatch.setattr(autotune, "CLOSE_MAX", 2)
    only(*(TimedBackend(f"b{i}", delay=0.001 * (1 + 0.03 * i), clock=clock) for i in range(3)))
    x, w = _operands(gen)
    gg.configure(autotune=True)
    gg.grouped_gemm(x, w, SPLITS)
    tuning = gg.explain(x, w, SPLITS).tuning
    assert tuning.choice == "b0" and tuning.close_call.labels == ("b0", "b1")
    third = {t.backend: t for t in tuning.timings}["b2"]
    assert third.note == "pruned: within 15 % but behind 2 closer contenders"
    assert third.ms == pytest.approx(1.06) and not third.usable


def test_a_close_call_takes_each_backends_fastest_before_a_second_config():
    # H200, 2026-12-05: three triton_grouped tiles within 0.3 % filled the close call and
    # torch_grouped_mm, 5 % behind in the rounds, the best measured separately, was pruned.
    times = {"t[a]": 1.354, "t[b]": 1.357, "t[c]": 1.415, "torch": 1.424, "multi": 1.47, "far": 1.6}
    backends = {"t[a]": "t", "t[b]": "t", "t[c]": "t", "torch": "torch", "multi": "multi", "far": "far"}
    assert autotune.close_to_fastest(times, backends=backends) == ["t[a]", "torch", "multi"]
    assert autotune.close_to_fastest(times) == ["t[a]", "t[b]", "t[c]"]  # labels alone: as before
    one_backend = {"t[a]": 1.0, "t[b]": 1.01, "t[c]": 1.02, "t[d]": 1.03}
    assert autotune.close_to_fastest(one_backend, backends=dict.fromkeys(one_backend, "t")) == ["t[a]", "t[b]", "t[c]"]
    far_other = {"t[a]": 1.0, "t[b]": 1.01, "u": 1.2}  # u beyond the margin: two tiles of t
    assert autotune.close_to_fastest(far_other, backends={"t[a]": "t", "t[b]": "t", "u": "u"}) == ["t[a]", "t[b]"]
    assert autotune.close_to_fastest({"t[a]": 1.0, "u": 1.2}, backends={"t[a]": "t", "u": "u"}) == []


def test_a_backends_near_equal_tiles_do_not_crowd_another_backend_out_of_the_close_call(only, gen, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(autotune, "Clock", clock)
    tiles = [{"delay": 0.00100 + 0.000002 * i, "tile": i} for i in range(3)]
    tiled = TimedBackend("tiled", delay=0.00101, configs=tiles, clock=clock)
    only(tiled, TimedBackend("vendor", delay=0.00105, priority=10, clock=clock))
    x, w = _operands(gen)
    gg.configure(autotune=True)
    _check_fwd(gg.grouped_gemm(x, w, SPLITS), x, w)
    tuning = gg.explain(x, w, SPLITS).tuning
    assert "vendor" in tuning.close_call.labels and len(tuning.close_call.labels) == autotune.CLOSE_MAX
    assert {t.backend: t for t in tuning.timings}["vendor"].usable


def test_paired_ms_cancels_a_drift_shared_by_neighbouring_blocks():
    # the machine slows 2 % per block; B is 5 % slower than A; one call of A hiccups
    a = [[1.00] * 3, [1.02, 1.02, 1.60], [1.04] * 3, [1.06] * 3]
    b = [[1.05 * (1.00 + 0.02 * i)] * 3 for i in range(4)]
    base, other = autotune.paired_ms([a, b])
    assert base == pytest.approx(1.04)  # A's median over all its calls
    assert other == pytest.approx(1.04 * 1.05)


def test_equal_speeds_go_to_declared_priority(only, gen, monkeypatch):
    monkeypatch.setattr(autotune, "TIE_MARGIN", 0.5)  # sleep jitter on a loaded CI machine
    only(TimedBackend("lo", delay=0.002, priority=1), TimedBackend("hi", delay=0.002, priority=2))
    x, w = _operands(gen)
    with gg.use_backends(autotune=True):
        _check_fwd(gg.grouped_gemm(x, w, SPLITS), x, w)
        decision = gg.explain(x, w, SPLITS)
    assert decision.selected == "hi" and decision.tuning.choice == "hi"


class _ExitingBackend(TimedBackend):
    """Calls sys.exit from run(): a plugin giving up the whole process."""

    def _compute(self, problem: gg.Problem, inputs: gg.GroupedInputs, delay: float) -> torch.Tensor:
        sys.exit("exiting contender")


def test_disagreeing_and_raising_backends_are_excluded(only, gen):
    """Measurement caught Exception only until 608353f: a contender's sys.exit ended the
    caller's process in the middle of autotuning."""
    wrong = TimedBackend("wrong", priority=100, scale=1.01)  # fastest, but 1 % off: 40 dB
    broken = TimedBackend("broken", priority=90, fail=True)
    exiting = _ExitingBackend("exiting", priority=95)
    only(wrong, broken, exiting, TimedBackend("ok1", delay=0.001), TimedBackend("ok2", delay=0.001, priority=1))
    x, w = _operands(gen)
    gg.configure(autotune=True)
    _check_fwd(gg.grouped_gemm(x, w, SPLITS), x, w)
    decision = gg.explain(x, w, SPLITS)
    assert decision.selected in {"ok1", "ok2"}
    notes = {t.backend: t.note for t in decision.tuning.timings}
    assert notes["wrong"].startswith("disagrees with ok") and "dB <" in notes["wrong"]
    assert notes["broken"] == "raised RuntimeError: boom"
    assert notes["exiting"] == "raised SystemExit: exiting contender"
    assert "disagrees with" in decision.table()


def test_a_user_order_wins_and_nothing_is_measured(only, gen):
    only(TimedBackend("slow", delay=0.003), TimedBackend("fast"))
    x, w = _operands(gen)
    gg.configure(autotune=True)
    _check_fwd(gg.grouped_gemm(x, w, SPLITS, backend="slow"), x, w)
    with gg.use_backends("slow"):
        _check_fwd(gg.grouped_gemm(x, w, SPLITS), x, w)
    gg.configure(backends="slow")
    _check_fwd(gg.grouped_gemm(x, w, SPLITS), x, w)
    assert gg.explain(x, w, SPLITS).order_source == "configure"
    assert gg.dispatch_stats()["selected"] == {"slow": 3}
    assert gg.dispatch_stats()["autotune"]["tuned"] == 0
    with gg.use_backends(autotune=False):
        assert gg.explain(x, w, SPLITS).order_source == "configure"


def test_scope_turns_autotune_off_inside_a_global_on(only, gen):
    only(TimedBackend("slow", delay=0.003, priority=5), TimedBackend("fast"))
    x, w = _operands(gen)
    gg.configure(autotune=True)
    with gg.use_backends(autotune=False):
        gg.grouped_gemm(x, w, SPLITS)
        assert gg.explain(x, w, SPLITS).order_source == "priority"
    assert gg.dispatch_stats()["selected"] == {"slow": 1}
    assert gg.dispatch_stats()["autotune"]["tuned"] == 0


def test_nothing_is_measured_under_capture_or_compile(only, gen, monkeypatch):
    only(TimedBackend("slow", delay=0.004, priority=5), TimedBackend("fast"))
    x, w = _operands(gen)
    gg.configure(autotune=True)
    call = validation.fwd_or_dgrad("fwd", x, w, SPLITS, None, None, None)
    capturing = dataclasses.replace(call, key=call.key._replace(capturing=True))
    out = DISPATCHER.run(capturing, None)
    _check_fwd(out, x, w)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    _check_fwd(gg.grouped_gemm(x, w, SPLITS), x, w)
    assert gg.dispatch_stats()["selected"] == {"slow": 2}  # declared priority both times
    assert gg.dispatch_stats()["autotune"]["tuned"] == 0
    assert gg.explain(x, w, SPLITS).tune_pending
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    _check_fwd(gg.grouped_gemm(x, w, SPLITS), x, w)  # the first eager call measures
    assert gg.dispatch_stats()["autotune"]["tuned"] == 1
    gg.reset_dispatch_stats()
    out = DISPATCHER.run(capturing, None)  # the stored choice now
    _check_fwd(out, x, w)
    assert gg.dispatch_stats()["selected"] == {"fast": 1}
    assert gg.dispatch_stats()["autotune"]["tuned"] == 0


def test_wgrad_accumulate_tunes_without_touching_the_callers_buffer(only, gen):
    only(TimedBackend("slow", delay=0.004, priority=5), TimedBackend("fast"))
    dy, x = torch.randn(sum(SPLITS), 24, generator=gen), torch.randn(sum(SPLITS), 32, generator=gen)
    init = torch.randn(len(SPLITS), 24, 32, generator=gen)
    buffer = init.clone()
    gg.configure(autotune=True)
    gg.grouped_gemm_wgrad(dy, x, SPLITS, out=buffer, accumulate=True)
    assert gg.dispatch_stats()["autotune"]["tuned"] == 1
    expected = testing.ref_wgrad(dy, x, SPLITS) + init.double()
    assert testing.rel_error(buffer, expected) < 1e-5  # added exactly once
    assert torch.equal(buffer[1], init[1])  # the empty group is left alone


def test_backend_configs_are_tuned_and_used(only, gen):
    tiled = TimedBackend("tiled", delay=0.004, configs=[{"delay": 0.004, "tile": 1}, {"delay": 0.0005, "tile": 2}])
    only(tiled)  # the only backend: its configs alone are worth tuning
    x, w = _operands(gen)
    gg.configure(autotune=True)
    _check_fwd(gg.grouped_gemm(x, w, SPLITS), x, w)
    decision = gg.explain(x, w, SPLITS)
    assert decision.selected == "tiled" and decision.config == {"delay": 0.0005, "tile": 2}
    assert "tiled[delay=0.0005,tile=2]" in decision.table()
    key = json.dumps(decision.config, sort_keys=True)
    before, runs = tiled.config_runs[key], tiled.runs
    _check_fwd(gg.grouped_gemm(x, w, SPLITS), x, w)
    assert tiled.config_runs[key] == before + 1 and tiled.runs == runs


def test_a_broken_configs_hook_excludes_only_that_backend(only, gen):
    bad = TimedBackend("bad", priority=9)
    bad.configs = lambda problem: [{"obj": object()}]
    only(bad, TimedBackend("good", delay=0.001))
    x, w = _operands(gen)
    gg.configure(autotune=True)
    _check_fwd(gg.grouped_gemm(x, w, SPLITS), x, w)
    decision = gg.explain(x, w, SPLITS)
    assert decision.selected == "good"
    assert "not JSON scalars" in {t.backend: t.note for t in decision.tuning.timings}["bad"]


def test_a_backend_that_cannot_prepare_is_not_timed(only, gen):
    """Autotuning prepares every contender, not only the selected one: a contender whose
    preparation fails is excluded with its reason and never run; the others are timed."""
    unready = TimedBackend("unready", priority=1)
    unready.prepare = lambda problem: [gg.Reason("build", "nvcc failed; log: /tmp/build.log")]
    slow, fast = TimedBackend("slow", delay=0.003, priority=9), TimedBackend("fast", priority=5)
    only(unready, slow, fast)
    x, w = _operands(gen)
    gg.configure(autotune=True)
    _check_fwd(gg.grouped_gemm(x, w, SPLITS), x, w)
    decision = gg.explain(x, w, SPLITS)
    assert decision.selected == "fast" and unready.runs == 0
    assert "nvcc failed" in {t.backend: t.note for t in decision.tuning.timings}["unready"]


def test_described_devices_are_never_measured(only, gen):
    only(TimedBackend("slow", delay=0.003, priority=5), TimedBackend("fast"))
    x, w = _operands(gen)
    gg.configure(autotune=True)
    with emulated(gg.DeviceInfo.for_arch("cpu")):
        gg.grouped_gemm(x, w, SPLITS)
    assert gg.dispatch_stats()["selected"] == {"slow": 1}
    assert gg.dispatch_stats()["autotune"]["tuned"] == 0


def test_autotune_settings_are_validated(monkeypatch):
    monkeypatch.setenv("GROUPED_GEMM_AUTOTUNE", "on")
    assert gg.reset_config().autotune is True
    monkeypatch.setenv("GROUPED_GEMM_AUTOTUNE", "maybe")
    with pytest.raises(gg.ConfigError, match="GROUPED_GEMM_AUTOTUNE"):
        gg.reset_config()
    monkeypatch.delenv("GROUPED_GEMM_AUTOTUNE")
    with pytest.raises(gg.ConfigError, match="autotune"), gg.use_backends(autotune="yes"):
        pass


def test_agreement_measure():
    a = torch.tensor([1.0, 2.0, float("nan")])
    assert autotune.agreement_db(a, a.clone()) == math.inf
    assert autotune.agreement_db(a, torch.tensor([1.0, 2.0, 3.0])) == -math.inf  # NaN elsewhere
    assert autotune.agreement_db(a, torch.tensor([1.0, 2.0, 3.0]).reshape(3, 1)) == -math.inf
    assert autotune.agreement_db(a, torch.tensor([1.1, 2.0, float("nan")])) == pytest.approx(
        10 * math.log10(5.0 / 0.01)
    )
    assert autotune.agreement_floor_db("bfloat16") == pytest.approx(42.16, abs=0.01)
    assert autotune.agreement_floor_db("float32") == 50.0


def test_a_second_process_loads_the_choice_and_does_not_measure(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning_store.ENV_CACHE_DIR, str(tmp_path))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        first = _fakes.tune_once()
    finally:
        torch.set_num_threads(threads)
    assert first["autotune"]["tuned"] == 1 and first["autotune"]["loaded"] == 0
    (stored,) = (tmp_path / "autotune").glob("*.json")
    assert first["selected"] in stored.read_text()
    done = subprocess.run(
        [sys.executable, str(HERE / "autotune_fakes.py")],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    second = json.loads(done.stdout.strip().splitlines()[-1])
    assert second["autotune"] == {"tuned": 0, "close_calls": 0, "loaded": 1, "calls": 0, "tuning_ms": 0.0}
    assert second["selected"] == first["selected"]


def test_a_corrupt_or_stale_file_is_ignored_with_a_warning(only, gen):
    only(TimedBackend("slow", delay=0.003, priority=5), TimedBackend("fast"))
    x, w = _operands(gen)
    gg.configure(autotune=True)
    problem = validation.fwd_or_dgrad("fwd", x, w, SPLITS, None, None, None).problem()
    path = autotune.TUNER.file_for(problem.device)
    path.parent.mkdir(parents=True)
    path.write_text("{ not json")
    with pytest.warns(AutotuneCacheWarning, match="corrupt"):
        _check_fwd(gg.grouped_gemm(x, w, SPLITS), x, w)
    assert gg.dispatch_stats()["autotune"]["tuned"] == 1
    document = json.loads(path.read_text())  # rewritten whole
    assert list(document["entries"]) == [autotune.tuning_key(problem)]
    document["versions"]["torch"] = "0.0"
    header = {k: v for k, v in document.items() if k != "entries" and k != "schema"}
    with pytest.warns(AutotuneCacheWarning, match="stale"):
        assert tuning_store.load(path, {**header, "versions": {"torch": "1.0"}}) == {}


def _tuned_file(gen) -> tuple[Path, dict, torch.Tensor, torch.Tensor]:
    """Tune one fwd signature (slow / fast fakes); the file, its document and the operands."""
    x, w = _operands(gen)
    gg.configure(autotune=True)
    _check_fwd(gg.grouped_gemm(x, w, SPLITS), x, w)
    problem = validation.fwd_or_dgrad("fwd", x, w, SPLITS, None, None, None).problem()
    path = autotune.TUNER.file_for(problem.device)
    return path, json.loads(path.read_text()), x, w


def _reloaded() -> None:
    """A fresh process's view: the tuner forgets the tables it read, the dispatcher its
    routes (``configure`` drops them)."""
    autotune.TUNER._tables.clear()
    gg.configure(autotune=True)


@pytest.mark.parametrize(
    "edit",
    ["nested_brackets", "nan_time", "negative_time", "config_not_offered"],
)
def test_a_hand_edited_or_corrupt_entry_is_ignored_not_raised(edit, only, gen):
    """A store file of deeply nested brackets raised RecursionError from the GEMM call; a NaN
    (which json.dump writes) or negative time raised ValueError in the ranking; a stored
    config the backend does not offer made every call fail inside the backend (or with an
    AttributeError for a backend without run_config). Each is now ignored with a warning,
    and the call runs."""
    only(TimedBackend("slow", delay=0.003, priority=5), TimedBackend("fast"))
    path, document, x, w = _tuned_file(gen)
    entry = next(iter(document["entries"].values()))
    if edit == "nested_brackets":
        path.write_text("[" * 100_000)
    else:
        timing = next(t for t in entry["timings"] if t["backend"] == entry["choice"])
        if edit == "config_not_offered":
            timing["config"] = entry["config"] = {"bm": 7}
        else:
            timing["ms"] = math.nan if edit == "nan_time" else -0.5
        path.write_text(json.dumps(document))
    _reloaded()
    with pytest.warns(AutotuneCacheWarning, match="corrupt|does not offer"):
        _check_fwd(gg.grouped_gemm(x, w, SPLITS), x, w)


def test_tune_show_reports_a_corrupt_file_without_a_traceback(only, gen, capsys):
    only(TimedBackend("slow", delay=0.003, priority=5), TimedBackend("fast"))
    path, document, _, _ = _tuned_file(gen)
    for bad in (json.dumps({**document, "versions": "2.13"}), "[" * 100_000):
        path.write_text(bad)
        with pytest.warns(AutotuneCacheWarning):
            assert cli.main(["tune", "--show"]) == 0
        assert "0 choice(s)" in capsys.readouterr().out


def test_concurrent_writers_leave_a_valid_file_with_every_entry(tmp_path):
    path = tmp_path / "autotune" / "x.json"
    # tuning_store needs only the standard library: the writers load it without torch.
    script = (
        "import importlib.util, sys; from pathlib import Path\n"
        f"spec = importlib.util.spec_from_file_location('tuning_store', {tuning_store.__file__!r})\n"
        "s = sys.modules['tuning_store'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(s)\n"
        "t = s.Tuning('k', 'p', 1, 'a', None, 'a', (s.Timing('a', None, 1.0, 3),), 1.0, 'now')\n"
        "for i in range(25):\n"
        "    s.save(Path(sys.argv[1]), {'device': 'd'}, {f'{sys.argv[2]}{i}': t})\n"
    )
    writers = [subprocess.Popen([sys.executable, "-c", script, str(path), tag]) for tag in ("a", "b")]
    assert all(p.wait(timeout=120) == 0 for p in writers)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        entries = tuning_store.load(path, {"device": "d"})
    assert sorted(entries) == sorted(f"{tag}{i}" for tag in "ab" for i in range(25))
    assert all(isinstance(e, Tuning) and e.origin == "loaded" for e in entries.values())
    assert not list(path.parent.glob("*.tmp"))


def test_tune_command_pretunes_and_shows(only, capsys):
    only(TimedBackend("slow", delay=0.003, priority=5), TimedBackend("fast"))
    # No --scale: on the CPU tune takes bench's smoke scale (0.01; it tuned full shapes once).
    argv = ["tune", "--cases", "qwen3_30b_gateup_decode", "--ops", "fwd,wgrad"]
    assert cli.main([*argv, "--splits", "skewed", "--recipe", "fp32", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("qwen3_30b_gateup_decode")]
    assert [(r[2], r[4], r[5], r[-1]) for r in rows] == [
        ("fwd", "fast", "slow", "measured"),
        ("wgrad", "fast", "slow", "measured"),
    ]
    assert "tuned 2 signature(s)" in out
    assert cli.main(["tune", "--show"]) == 0
    shown = capsys.readouterr().out
    assert "(this machine, loaded now)" in shown and "2 choice(s)" in shown
    assert "fwd fp32 G=128 M=5 N=32 K=32" in shown


@pytest.mark.gpu
def test_gpu_bf16_tunes_on_the_device_and_captures_with_the_stored_choice(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning_store.ENV_CACHE_DIR, str(tmp_path))
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    splits = gg.skewed_splits(8, 4096)
    bf16 = dict(device=device, dtype=torch.bfloat16)
    x = torch.randn(4096, 1024, generator=gen, **bf16)
    w = torch.randn(8, 512, 1024, generator=gen, **bf16) / 32
    dy = torch.randn(4096, 512, generator=gen, **bf16)
    gg.configure(autotune=True)
    y = gg.grouped_gemm(x, w, splits, out=testing.poison(torch.empty(4096, 512, **bf16)))
    assert testing.sqnr_db(y, testing.ref_fwd(x, w, splits)) >= 40.0
    decision = gg.explain(x, w, splits)
    assert decision.order_source == "autotune" and decision.tuning.origin == "measured"
    # torch_grouped_mm and multistream are both measured; on the H200 multistream's probe is
    # over twice the fastest, so it is pruned and keeps only that probe time.
    timed = [t for t in decision.tuning.timings if t.ms is not None]
    assert len(timed) >= 2 and any(t.usable for t in timed)
    chosen = decision.tuning.fastest_ms(decision.selected)
    assert chosen <= min(t.ms for t in timed) * (1 + autotune.TIE_MARGIN)
    # wgrad into an fp32 main_grad: tuning leaves it alone, the real run adds exactly once
    main_grad = torch.randn(8, 512, 1024, generator=gen, device=device)
    init = main_grad.clone()
    gg.grouped_gemm_wgrad(dy, x, splits, out=main_grad, accumulate=True)
    assert testing.rel_error(main_grad, testing.ref_wgrad(dy, x, splits) + init.double()) < 1e-4
    assert gg.dispatch_stats()["autotune"]["tuned"] == 2
    # device splits: tuned eagerly, then captured without measuring (a sync would break capture)
    dev_splits = torch.tensor(splits, device=device)
    gg.grouped_gemm(x, w, dev_splits)
    tuned = gg.dispatch_stats()["autotune"]["tuned"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gg.grouped_gemm(x, w, dev_splits)
    captured.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert testing.sqnr_db(captured, testing.ref_fwd(x, w, splits)) >= 40.0
    assert gg.dispatch_stats()["autotune"]["tuned"] == tuned
