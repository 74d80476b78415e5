"""Dispatch: candidate order at every level, strict mode, warnings, cache, stats, threads."""

from __future__ import annotations

import logging
import threading
import warnings

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm.testing import ref_fwd, rel_error


@pytest.fixture
def args(gen):
    return torch.randn(12, 8, generator=gen), torch.randn(3, 4, 8, generator=gen), [5, 0, 7]


@pytest.fixture
def trio(make_backend):
    """Three eligible fake backends with declared priorities 300 > 200 > 100."""
    return {name: make_backend(name, priority=p) for name, p in (("hi", 300), ("mid", 200), ("lo", 100))}


def selected(args, **kw) -> str:
    x, w, s = args
    return gg.explain(x, w, s, **kw).selected


def test_declared_priority_decides_without_preferences(args, trio):
    assert selected(args) == "hi"
    x, w, s = args
    assert rel_error(gg.grouped_gemm(x, w, s), ref_fwd(x, w, s)) < 1e-6
    assert trio["hi"].runs == 1


def test_env_order_beats_priority(args, trio, monkeypatch):
    monkeypatch.setenv("GROUPED_GEMM_BACKENDS", "lo,mid")
    gg.reset_config()
    decision = gg.explain(*args)
    assert decision.selected == "lo"
    assert decision.order_source == "env"
    assert [c.name for c in decision.candidates][:3] == ["lo", "mid", "hi"]


def test_env_per_recipe_syntax(args, trio, monkeypatch):
    monkeypatch.setenv("GROUPED_GEMM_BACKENDS", "bf16:lo;fp32:mid,lo")
    gg.reset_config()
    assert selected(args) == "mid"
    x, w, s = args
    assert gg.explain(x.bfloat16(), w.bfloat16(), s).selected == "lo"


def test_configure_beats_env(args, trio, monkeypatch):
    monkeypatch.setenv("GROUPED_GEMM_BACKENDS", "lo")
    gg.reset_config()
    gg.configure(backends=["mid"])
    decision = gg.explain(*args)
    assert (decision.selected, decision.order_source) == ("mid", "configure")


def test_scope_beats_configure_and_nests(args, trio):
    gg.configure(backends="lo")
    with gg.use_backends("mid"):
        assert selected(args) == "mid"
        with gg.use_backends({"bf16": ["hi"]}):
            assert selected(args) == "mid"  # inner scope has no fp32 entry
        with gg.use_backends(["hi"]):
            decision = gg.explain(*args)
            assert (decision.selected, decision.order_source) == ("hi", "scope")
        assert selected(args) == "mid"
    assert selected(args) == "lo"


def test_per_call_beats_scope(args, trio):
    with gg.use_backends("mid"):
        decision = gg.explain(*args, backend="lo")
        assert (decision.selected, decision.order_source) == ("lo", "call")
        x, w, s = args
        gg.grouped_gemm(x, w, s, backend="lo")
    assert trio["lo"].runs == 1


def test_ineligible_preference_falls_back_by_priority(args, make_backend, trio):
    make_backend("broken", priority=1000, reasons=[gg.Reason("missing", "library libfoo not found")])
    decision = gg.explain(*args, backend="broken")
    assert decision.selected == "hi"
    assert decision.fallback
    assert [c.name for c in decision.skipped] == ["broken"]
    assert "libfoo" in decision.summary()


def test_strict_mode_raises_listing_every_reason(args, make_backend, trio):
    make_backend("broken", reasons=[gg.Reason("missing", "library libfoo not found")])
    x, w, s = args
    with gg.use_backends("broken", strict=True), pytest.raises(gg.BackendUnavailableError) as info:
        gg.grouped_gemm(x, w, s)
    message = str(info.value)
    assert "libfoo" in message
    assert "strict mode: not among the named backends" in message
    assert info.value.decision.selected is None


def test_strict_from_environment(args, make_backend, trio, monkeypatch):
    make_backend("broken", reasons=[gg.Reason("missing", "nope")])
    monkeypatch.setenv("GROUPED_GEMM_STRICT", "1")
    monkeypatch.setenv("GROUPED_GEMM_BACKENDS", "broken")
    gg.reset_config()
    with pytest.raises(gg.BackendUnavailableError):
        gg.grouped_gemm(*args)


def test_declared_reasons_are_uniform(make_backend):
    make_backend("picky", priority=500, k_multiple=128, n_multiple=16, max_groups=2, archs=("gfx950",))
    decision = gg.explain(op="fwd", groups=3, m=64, n=20, k=7000, recipe="fp32", device="gfx950")
    reasons = {r.code: r.message for r in decision.candidate("picky").reasons}
    assert reasons["align"] in ("K=7000 is not a multiple of 128", "N=20 is not a multiple of 16")
    assert reasons["groups"] == "G=3 exceeds the maximum 2"
    decision = gg.explain(op="fwd", groups=2, m=64, n=32, k=1024, recipe="fp32", device="sm_90")
    assert decision.candidate("picky").reasons[0].message == "arch sm_90 not supported; supports gfx950"


def test_per_group_row_alignment_is_checked(make_backend):
    make_backend("aligned", priority=500, m_multiple=16)
    assert gg.explain(op="fwd", groups=4, m=128, n=16, k=16, recipe="fp32", splits=[32, 0, 64, 32]).selected == (
        "aligned"
    )
    decision = gg.explain(op="fwd", groups=4, m=128, n=16, k=16, recipe="fp32", splits=[40, 0, 56, 32])
    assert decision.selected != "aligned"
    assert "only multiples of 8" in str(decision.candidate("aligned").reasons[0])
    decision = gg.explain(op="fwd", groups=4, m=128, n=16, k=16, recipe="fp32", device_splits=True)
    assert "on the device" in str(decision.candidate("aligned").reasons[0])


def test_capture_reason_for_host_split_backends(make_backend):
    make_backend("hosty", priority=500, host_splits=True)
    problem = gg.describe_problem(groups=2, m=8, n=8, k=8, recipe="fp32")
    from dataclasses import replace

    from grouped_gemm.dispatch import decide

    decision, _ = decide(replace(problem, capturing=True))
    codes = [r.code for r in decision.candidate("hosty").reasons]
    assert codes == ["capture"]


def test_fallback_warning_once_per_signature(args, make_backend, trio):
    make_backend("broken", priority=1000, reasons=[gg.Reason("missing", "nope")])
    x, w, s = args
    gg.configure(warn_fallback=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            gg.grouped_gemm(x, w, s)
        gg.grouped_gemm(x[:5], w, [5, 0, 0])  # another signature (M bucket 8 vs 16)
    fallback = [c for c in caught if issubclass(c.category, gg.FallbackWarning)]
    assert len(fallback) == 2
    assert "broken: [missing] nope" in str(fallback[0].message)
    assert "selected hi" in str(fallback[0].message)


def test_no_warning_unless_switched_on(args, make_backend, trio):
    make_backend("broken", priority=1000, reasons=[gg.Reason("missing", "nope")])
    with warnings.catch_warnings():
        warnings.simplefilter("error", gg.FallbackWarning)
        gg.grouped_gemm(*args)


def test_warning_switched_on_by_environment_and_scope(args, make_backend, trio, monkeypatch):
    make_backend("broken", priority=1000, reasons=[gg.Reason("missing", "nope")])
    monkeypatch.setenv("GROUPED_GEMM_WARN_FALLBACK", "yes")
    gg.reset_config()
    with pytest.warns(gg.FallbackWarning):
        gg.grouped_gemm(*args)
    gg.reset_dispatch_stats()
    with gg.use_backends(warn_fallback=False), warnings.catch_warnings():
        warnings.simplefilter("error", gg.FallbackWarning)
        gg.grouped_gemm(*args)


def test_reasons_logged_at_debug(args, trio, caplog):
    with caplog.at_level(logging.DEBUG, logger="grouped_gemm"):
        gg.grouped_gemm(*args)
    assert any("selected: hi" in r.getMessage() for r in caplog.records)


def test_decision_is_cached_per_signature(args, trio):
    x, w, s = args
    gg.grouped_gemm(x, w, s)
    checks = trio["hi"].checks
    for _ in range(5):
        gg.grouped_gemm(x, w, s)
    gg.grouped_gemm(x[:10], w, [5, 0, 5])  # M 10 and 12 share the power-of-two bucket 16
    assert trio["hi"].checks == checks
    assert trio["hi"].runs == 7


def test_a_route_keeps_one_problem_per_m_of_its_bucket(args, trio, monkeypatch):
    """Calls alternating between two M of one bucket each get a Problem of their own M
    (the output shape follows it), built once per M and then reused."""
    x, w, _ = args
    seen = []
    real_run = trio["hi"].run
    monkeypatch.setattr(trio["hi"], "run", lambda problem, inputs: seen.append(problem) or real_run(problem, inputs))
    # One route: M 10 and 12 share a bucket, and every split's largest group and alignment agree.
    for m, splits in [(12, [5, 0, 7]), (10, [5, 0, 5]), (12, [7, 5, 0]), (10, [3, 7, 0])]:
        out = gg.grouped_gemm(x[:m], w, splits)
        assert rel_error(out, ref_fwd(x[:m], w, splits)) < 1e-6
    assert [p.m for p in seen] == [12, 10, 12, 10]
    assert seen[2] is seen[0] and seen[3] is seen[1]  # built once per M, then looked up
    assert trio["hi"].checks == 1  # one decision for the bucket


def test_cache_invalidated_by_configure_and_registration(args, trio, make_backend):
    assert selected(args) == "hi"
    x, w, s = args
    gg.grouped_gemm(x, w, s)
    gg.configure(backends=["mid"])
    gg.grouped_gemm(x, w, s)
    assert trio["mid"].runs == 1
    gg.configure(backends=None)
    make_backend("top", priority=10_000)
    gg.grouped_gemm(x, w, s)
    assert gg.dispatch_stats()["selected"]["top"] == 1


def test_backend_exception_propagates_with_its_name(args, make_backend):
    class Boom(RuntimeError):
        pass

    backend = make_backend("exploding", priority=10_000)

    def explode(problem, inputs):
        raise Boom("kernel fault")

    backend.run = explode
    with pytest.raises(gg.BackendRunError, match="backend 'exploding' failed on fwd fp32 G=3") as info:
        gg.grouped_gemm(*args)
    assert isinstance(info.value.__cause__, Boom)
    assert backend.checks >= 1


def test_broken_check_becomes_a_reason(args, make_backend, trio):
    backend = make_backend("buggy", priority=10_000)

    def bad_check(problem):
        raise KeyError("oops")

    backend.check = bad_check
    decision = gg.explain(*args)
    assert decision.selected == "hi"
    assert "check() raised KeyError" in str(decision.candidate("buggy").reasons[0])


def test_problem_dependent_priority(args, make_backend, trio):
    backend = make_backend("sized", priority=0)
    backend.priority = lambda problem: 1000 if problem.groups <= 3 else -1
    assert selected(args) == "sized"
    x = torch.randn(12, 8)
    assert gg.explain(x, torch.randn(4, 4, 8), [3, 3, 3, 3]).selected == "hi"


def test_ties_broken_by_name_not_load_order(args, make_backend):
    make_backend("zeta", priority=5000)
    make_backend("alpha", priority=5000)
    assert selected(args) == "alpha"


def test_dispatch_stats_count_selections_and_fallbacks(args, make_backend, trio):
    make_backend("broken", priority=1000, reasons=[gg.Reason("missing", "nope")])
    x, w, s = args
    for _ in range(3):
        gg.grouped_gemm(x, w, s)
    gg.grouped_gemm(x, w, s, backend="lo")
    gg.grouped_gemm(x, w, s, backend="broken,lo")
    stats = gg.dispatch_stats()
    assert stats["calls"] == 5
    assert stats["selected"] == {"hi": 3, "lo": 2}
    # Only skips of backends the user named are fallbacks, keyed "skipped -> selected":
    # "broken" outranking "hi" by priority was never asked for.
    assert stats["fallbacks"] == {"broken -> lo": 1}
    assert stats["skipped"] == {"broken:missing": 4}


def test_concurrent_dispatch_with_different_scopes(args, trio):
    x, w, s = args
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)

    def worker(name: str) -> None:
        try:
            with gg.use_backends(name):
                barrier.wait()
                for _ in range(40):
                    decision = gg.explain(x, w, s)
                    assert decision.selected == name, decision.selected
                    gg.grouped_gemm(x, w, s)
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("hi", "mid", "lo") * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert {n: b.runs for n, b in trio.items()} == {"hi": 80, "mid": 80, "lo": 80}
    assert gg.dispatch_stats()["calls"] == 240


def test_not_in_the_running_is_not_a_fallback(args, make_backend, trio):
    make_backend("gpu_only", priority=10_000, vendors=frozenset({"cuda"}))
    decision = gg.explain(*args)
    assert decision.selected == "hi"
    assert not decision.fallback
    assert decision.candidate("gpu_only").reasons[0].code == "vendor"


def test_scopes_are_local_to_asyncio_tasks(args, trio):
    import asyncio

    async def task(name: str) -> str:
        with gg.use_backends(name):
            await asyncio.sleep(0.01)
            return selected(args)

    async def both() -> list[str]:
        return await asyncio.gather(task("lo"), task("mid"))

    assert asyncio.run(both()) == ["lo", "mid"]


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_dispatch_works_in_a_forked_child(args, trio):
    import os

    x, w, s = args
    gg.grouped_gemm(x, w, s)
    pid = os.fork()
    if pid == 0:
        try:
            ok = rel_error(gg.grouped_gemm(x, w, s), ref_fwd(x, w, s)) < 1e-6
            os._exit(0 if ok and gg.dispatch_stats()["calls"] >= 1 else 1)
        except BaseException:  # noqa: BLE001 - a forked child must never return into pytest
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_backend_for_other_recipes_is_not_a_fallback_whatever_else_it_says(args, make_backend, trio):
    make_backend(
        "mx_only", priority=10_000, recipes=frozenset({"mxfp4"}), reasons=[gg.Reason("missing", "no interpreter")]
    )
    decision = gg.explain(*args)
    assert decision.selected == "hi" and not decision.fallback
    assert gg.explain(*args, backend="mx_only").fallback


def test_fallback_warning_points_at_the_caller(args, make_backend, trio):
    make_backend("broken", priority=1000, reasons=[gg.Reason("missing", "nope")])
    gg.configure(warn_fallback=True)
    with pytest.warns(gg.FallbackWarning) as record:
        gg.grouped_gemm(*args)
    assert record[0].filename == __file__


# ---- prepare: slow readiness work, only for the backend about to run ----------------------


def _preparing(backend, answer):
    """Make ``backend.prepare`` record its calls and answer ``answer`` (a list, or an
    exception to raise)."""
    backend.prepared = 0

    def prepare(problem):
        backend.prepared += 1
        if isinstance(answer, Exception):
            raise answer
        return answer

    backend.prepare = prepare
    return backend


def test_only_the_selected_backend_prepares_once_per_route(args, trio):
    for backend in trio.values():
        _preparing(backend, [])
    x, w, s = args
    for _ in range(3):
        assert rel_error(gg.grouped_gemm(x, w, s), ref_fwd(x, w, s)) < 1e-6
    assert [trio[n].prepared for n in ("hi", "mid", "lo")] == [1, 0, 0]


@pytest.mark.parametrize(
    "answer, code",
    [
        ([gg.Reason("build", "nvcc failed; log: /tmp/x.log")], "build"),
        (RuntimeError("boom"), "plugin"),
        ("not a list", "plugin"),
    ],
)
def test_a_backend_that_cannot_prepare_gives_way_to_the_next(args, trio, answer, code):
    _preparing(trio["hi"], answer)
    _preparing(trio["mid"], [])
    x, w, s = args
    assert rel_error(gg.grouped_gemm(x, w, s), ref_fwd(x, w, s)) < 1e-6
    assert (trio["hi"].runs, trio["mid"].runs, trio["mid"].prepared) == (0, 1, 1)
    decision = gg.explain(x, w, s)
    assert decision.selected == "mid"
    assert [r.code for r in decision.candidate("hi").reasons] == [code]
    assert "hi" in decision.table() and f"[{code}]" in decision.table()


def test_a_described_device_prepares_nothing(args, trio):
    """``explain`` of a described problem (a device that is not here) decides without
    preparing: a build for that chip would be for hardware this process cannot run on."""
    _preparing(trio["hi"], [gg.Reason("build", "would build for the described chip")])
    decision = gg.explain(groups=3, m=12, n=4, k=8, recipe="fp32", device="cpu")
    assert not decision.problem.device.detected
    assert decision.selected == "hi" and trio["hi"].prepared == 0
    x, w, s = args
    assert rel_error(gg.grouped_gemm(x, w, s), ref_fwd(x, w, s)) < 1e-6
    assert trio["hi"].prepared == 1 and trio["hi"].runs == 0  # a real call prepares: it gives way


def test_a_named_backend_that_cannot_prepare_is_a_fallback(args, trio):
    """The preferred backend's preparation failing is reported like any skip: it warns (when
    switched on) and names the reason."""
    _preparing(trio["lo"], [gg.Reason("build", "no compiler")])
    gg.configure(warn_fallback=True)
    x, w, s = args
    with pytest.warns(gg.FallbackWarning, match=r"lo: \[build\] no compiler"):
        gg.grouped_gemm(x, w, s, backend="lo")
    assert trio["hi"].runs == 1 and trio["lo"].runs == 0
