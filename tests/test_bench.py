"""grouped-gemm bench: shapes, metrics, timing, the sampled accuracy check, and CPU smoke runs."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from forked_runs import run_forked

import grouped_gemm as gg
from grouped_gemm.bench import accuracy, ceilings, metrics, operands, plot, report, runner, shapes, timing
from grouped_gemm.cli import main

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ["--scale", "0.01", "--warmup-ms", "0", "--rep-ms", "1", "--min-reps", "2", "--max-reps", "3"]


# --- shapes ---------------------------------------------------------------------------


def test_shapes_ship_with_the_package_and_benchmarks_points_at_them():
    packaged = json.loads((ROOT / "grouped_gemm" / "bench" / "moe_shapes.json").read_text())
    assert json.loads((ROOT / "benchmarks" / "moe_shapes.json").read_text()) == packaged
    assert shapes.shapes_document() == packaged
    shared = ROOT.parent / "shared" / "moe_shapes.json"
    if shared.exists():  # the project's source of truth, beside the checkout in sessions and CI
        assert json.loads(shared.read_text()) == packaged
    names = [c.name for c in shapes.all_cases()]
    assert len(names) == 12 and names[0] == "dsv3_gateup_ep8" and "gptoss120b_gateup_decode" in names


def test_select_cases_all_subset_and_errors():
    assert [c.name for c in shapes.select_cases("all")] == [c.name for c in shapes.all_cases()]
    chosen = shapes.select_cases("qwen3_30b_gateup, dsv3_gateup_ep8,qwen3_30b_gateup")
    assert [c.name for c in chosen] == ["qwen3_30b_gateup", "dsv3_gateup_ep8"]
    assert (chosen[1].groups, chosen[1].m, chosen[1].n, chosen[1].k) == (32, 16384, 4096, 7168)
    with pytest.raises(gg.InvalidArgumentError, match=r"cases='nope'.*dsv3_gateup_ep8"):
        shapes.select_cases("dsv3_gateup_ep8,nope")
    with pytest.raises(gg.InvalidArgumentError, match="'all' alone"):
        shapes.select_cases("all,dsv3_gateup_ep8")
    for bad in (0, -1, 1.5, float("nan")):
        with pytest.raises(gg.InvalidArgumentError, match="scale"):
            shapes.select_cases("all", bad)


def test_rows_per_group_runs_each_case_at_each_token_count():
    base = shapes.select_cases("gptoss120b_down")[0]
    cases = shapes.select_cases("gptoss120b_down,qwen3_30b_down", rows_per_group="64, 128,64")
    assert [c.name for c in cases] == [
        "gptoss120b_down@64rpg",
        "gptoss120b_down@128rpg",
        "qwen3_30b_down@64rpg",
        "qwen3_30b_down@128rpg",
    ]
    assert (cases[1].groups, cases[1].m, cases[1].n, cases[1].k) == (base.groups, 128 * base.groups, base.n, base.k)
    assert sum(cases[0].splits("skewed")) == cases[0].m
    for bad in ("", "0", "-4", "1.5", "x", str(shapes.MAX_ROWS_PER_GROUP + 1)):
        with pytest.raises(gg.InvalidArgumentError, match="rows-per-group"):
            shapes.select_cases("gptoss120b_down", rows_per_group=bad)


def test_scaled_cases_keep_groups_and_round_dims_up_to_32():
    case = next(c for c in shapes.all_cases() if c.name == "qwen3_235b_gateup").scaled(0.01)
    assert (case.groups, case.m, case.n, case.k) == (128, 655, 32, 64)  # 30.72 -> 32, 40.96 -> 64
    tiny = shapes.Case("t", 4, 10, 4096, 100).scaled(0.001)
    assert (tiny.m, tiny.n, tiny.k) == (1, 32, 32)


def test_splits_follow_the_shapes_file_rules():
    case = shapes.Case("t", 7, 1000, 32, 32)
    assert case.splits("balanced") == [142] * 6 + [148]
    skewed = case.splits("skewed")
    assert skewed == gg.skewed_splits(7, 1000) and sum(skewed) == 1000 and max(skewed) > 2 * min(skewed)
    with pytest.raises(gg.InvalidArgumentError, match="splits='uniform'"):
        case.splits("uniform")


# --- metrics, operands, timing, ceilings ----------------------------------------------


def test_bytes_count_operands_output_and_only_weights_of_live_groups():
    p = gg.describe_problem(op="fwd", groups=4, m=10, n=6, k=8, recipe="bf16", splits=[3, 0, 7, 0])
    assert p.flops == 2 * 10 * 6 * 8
    assert metrics.bytes_moved(p) == 2 * (10 * 8 + 4 * 6 * 8 + 10 * 6)
    assert metrics.bytes_moved(p, live_groups=2) == 2 * (10 * 8 + 2 * 6 * 8 + 10 * 6)
    w = gg.describe_problem(op="wgrad", groups=4, m=10, n=6, k=8, out_dtype=torch.float32, accumulate=True)
    assert metrics.bytes_moved(w, live_groups=1) == 2 * 10 * 6 + 2 * 10 * 8 + 2 * 4 * 4 * 6 * 8
    assert metrics.element_bytes("mx_e2m1") == 0.5 + 1 / 32  # two elements a byte, one scale byte per 32


def test_rates_and_roofline_share():
    r = metrics.rates(flops=2e12, nbytes=1e9, ms=4.0, matmul_tflops=1000.0, copy_gbs=1000.0)
    assert r.tflops == pytest.approx(500.0) and r.gbs == pytest.approx(250.0)
    assert r.pct_of_ceiling == pytest.approx(100 * 2e-3 / 4e-3)  # compute-bound: 2 ms ideal of 4 ms
    bound = metrics.rates(flops=1e9, nbytes=4e9, ms=8.0, matmul_tflops=1000.0, copy_gbs=1000.0)
    assert bound.pct_of_ceiling == pytest.approx(50.0)  # memory-bound: 4 ms ideal of 8 ms
    assert metrics.rates(1.0, 1.0, 1.0, None, 1.0).pct_of_ceiling is None


def test_operands_are_random_and_rotated_past_the_l2(monkeypatch):
    case = shapes.Case("t", 3, 40, 32, 64)
    one = operands.make_operands("fwd", case, [10, 0, 30], torch.bfloat16, torch.device("cpu"), seed=1)
    assert len(one.sets) == 1 and one.splits == [10, 0, 30]
    a, b = one.first.a, one.first.b
    assert a.shape == (40, 64) and b.shape == (3, 32, 64) and a.dtype == torch.bfloat16
    assert (a != 0).float().mean() > 0.99 and b.float().std().item() == pytest.approx(64**-0.5, rel=0.2)
    per_set = (40 * 64 + 3 * 32 * 64) * 2
    monkeypatch.setattr(operands, "l2_bytes", lambda device: 4 * per_set)
    rotated = operands.make_operands("wgrad", case, [10, 0, 30], torch.bfloat16, torch.device("cpu"), seed=1)
    assert len(rotated.sets) == math.ceil(3 * 4 * per_set / ((40 * 32 + 40 * 64) * 2))
    assert not torch.equal(rotated.sets[0].a, rotated.sets[1].a)
    assert rotated.first.a.shape == (40, 32) and rotated.first.b.shape == (40, 64)


def test_host_timing_cycles_sets_and_respects_bounds():
    seen: list[int] = []
    plan = timing.TimingPlan(warmup_ms=0.0, rep_ms=1e6, min_reps=4, max_reps=7)
    times = timing.time_calls(seen.append, 3, torch.device("cpu"), plan)
    assert len(times) == 7 and all(t >= 0 for t in times)
    assert set(seen) == {0, 1, 2} and seen[-8:] == [0, 1, 2, 0, 1, 2, 0, 1]  # 1 warm-up, 7 timed


def test_rounds_spread_who_goes_first_warm_every_set_stagger_sets_and_isolate_a_failure():
    order: list[tuple[str, int]] = []
    calls = {"a": 0}

    def fails_later(i: int) -> None:
        calls["a"] += 1
        if calls["a"] > 6:
            raise RuntimeError("boom")

    plan = timing.TimingPlan(warmup_ms=0.0, rep_ms=1e6, min_reps=6, max_reps=6, rounds=3)
    assert plan.block(1.0, first=True) == (1, 2) and plan.block(1.0, first=False) == (1, 2)
    results = timing.time_in_rounds(
        [lambda i: order.append(("x", i)), fails_later, lambda i: order.append(("y", i))],
        [6, 1, 6],
        torch.device("cpu"),
        plan,
    )
    x, failed, y = results
    assert len(x.times_ms) == 6 and len(x.round_medians_ms) == 3 and x.error is None
    assert len(y.times_ms) == 6 and y.error is None
    assert isinstance(failed.error, RuntimeError) and "boom" in str(failed.error)
    # Each first runs once on every set, then 3 probe calls; the failing one's calls log nothing.
    assert order[:9] == [("x", i) for i in (0, 1, 2, 3, 4, 5, 0, 1, 2)]
    assert [i for name, i in order if name == "y"][:10] == [0, 1, 2, 3, 4, 5, 4, 5, 0, 4]  # y starts at set 2 * 6 // 3
    blocks = [name for name, _ in order[18:]]
    # Round r starts at r * live // rounds: x, y (the third failed in round 0); x, y; y, x.
    assert blocks == ["x"] * 3 + ["y"] * 3 + ["x"] * 3 + ["y"] * 3 + ["y"] * 3 + ["x"] * 3


def test_soak_runs_the_contenders_in_turn_for_its_time_and_isolates_a_failure():
    class GpuClock:  # a GPU's clock without a GPU: only ``cuda`` and ``sync`` are used
        cuda = True

        def sync(self) -> None:
            order.append(("sync", 0))

    order: list[tuple[str, int]] = []

    def broken(i: int) -> None:
        raise RuntimeError("boom")

    out = [timing.Timed() for _ in range(3)]
    calls = [lambda i: order.append(("a", i)), broken, lambda i: (order.append(("b", i)), time.sleep(0.002))]
    timing._soak(calls, [0, 1, 2], GpuClock(), 20.0, out)
    names = [name for name, _ in order]
    assert names[:3] == ["a", "b", "sync"] and names.count("a") == names.count("b") >= 2
    assert isinstance(out[1].error, RuntimeError) and out[0].error is None and out[2].error is None
    order.clear()
    timing._soak(calls, [0, 2], timing.Clock(False), 20.0, out)  # the host's clock: no soak
    assert order == []


def test_ceilings_on_the_cpu():
    measured = ceilings.measure({"bf16", "fp32"}, torch.device("cpu"))
    assert measured.matmul_tflops["bf16"] > 0 and measured.matmul_tflops["fp32"] > 0
    assert measured.copy_gbs > 0
    assert ceilings.matmul_kind("bf16") == "bf16" and ceilings.matmul_kind("mxfp4") == "fp8"
    assert ceilings.matmul_kind("a16w4") == "bf16" and ceilings.matmul_kind("fp32") == "fp32"


# --- the sampled accuracy check -------------------------------------------------------


@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
def test_sample_flags_a_wrong_edge_row_and_passes_the_exact_result(op, gen):
    splits = [50, 0, 300, 7, 0]
    m, n, k = sum(splits), 24, 40
    a = torch.randn(m, k if op == "fwd" else n, generator=gen)
    b = torch.randn(m, k, generator=gen) if op == "wgrad" else torch.randn(len(splits), n, k, generator=gen)
    ref = {"fwd": gg.testing.ref_fwd, "dgrad": gg.testing.ref_dgrad, "wgrad": gg.testing.ref_wgrad}[op]
    exact = ref(a, b, splits).float()
    sample = accuracy.sample_reference(op, a, b, splits, seed=3)
    assert sample.sqnr(exact) > 100
    broken = exact.clone()
    if op == "wgrad":
        broken[1] = 1.0  # an empty group's dw must be zero
    else:
        broken[349] += 5.0  # the last row of group 2
    assert sample.sqnr(broken) < 30


def test_sample_of_a_huge_group_stays_small(gen):
    splits = [5000, 3]
    a, w = torch.randn(5003, 16, generator=gen), torch.randn(2, 8, 16, generator=gen)
    sample = accuracy.sample_reference("fwd", a, w, splits)
    assert len(sample.rows) <= 2 * (2 * accuracy.EDGE_ROWS + accuracy.RANDOM_ROWS)
    assert {0, 4999, 5000, 5002} <= set(sample.rows.tolist())


# --- end to end on the CPU ------------------------------------------------------------


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["bench", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cpu_smoke_run_writes_table_json_and_markdown(tmp_path, capsys):
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    argv = ["--cases", "mixtral_down", "--ops", "fwd,dgrad,wgrad", "--splits", "balanced,skewed", "--recipe", "bf16"]
    code, out, err = _run(capsys, *argv, "--backends", "all", *SMOKE, "--out", str(out_json), "--markdown", str(out_md))
    assert code == 0, out + err
    assert "mixtral_down" in out and "torch._grouped_mm" in out and "6 problems" in out
    assert "[1/6]" in err and "[6/6]" in err and "done: 6 steps" in err
    doc = json.loads(out_json.read_text())
    env = doc["environment"]
    for key in ("date", "torch", "triton", "git", "device", "command", "python"):
        assert key in env
    assert env["device"]["type"] == "cpu" and doc["ceilings"]["copy_gbs"] > 0
    rows = doc["rows"]
    peers = [r for r in rows if r["role"] == "peer"]
    assert len(peers) == 6 and all(r["status"] == "ok" and r["backend"] == "torch._grouped_mm" for r in peers)
    refs = [r for r in rows if r["backend"] == "reference"]
    assert len(refs) == 6
    for r in refs:
        assert r["status"] == "ok" and r["sqnr_db"] >= r["sqnr_floor_db"] > 40
        assert len(r["times_ms"]) >= 2 and r["median_ms"] > 0 and r["tflops"] > 0 and r["vs_peer"] > 0
        # On the CPU a call is synchronous: its host time is its wall time, give or take.
        assert 0.5 * r["median_ms"] * 1e3 < r["host_us"] < 2.0 * r["median_ms"] * 1e3
        assert r["flops"] == 2 * r["m"] * r["n"] * r["k"] and (r["groups"], r["n"], r["k"]) == (8, 64, 160)
    md = out_md.read_text()
    assert "| case | G | M | N | K | splits | op | recipe | torch._grouped_mm |" in md and "Command:" in md
    assert md.count("| mixtral_down |") == 6


class _Wrong(gg.Backend):
    """Fast and wrong: every group multiplied by the first group's weight."""

    spec = gg.BackendSpec(
        name="bench_test_wrong", ops=frozenset({"fwd"}), recipes=frozenset({"bf16"}), vendors=frozenset({"cpu"})
    )

    def run(self, problem, inputs):
        return inputs.a @ inputs.b[0].T


class _Raises(gg.Backend):
    spec = gg.BackendSpec(
        name="bench_test_raises", ops=frozenset({"fwd"}), recipes=frozenset({"bf16"}), vendors=frozenset({"cpu"})
    )

    def run(self, problem, inputs):
        raise RuntimeError("kernel exploded")


@pytest.fixture
def bad_backends():
    backends = [_Wrong(), _Raises()]
    for b in backends:
        gg.register_backend(b)
    yield [b.spec.name for b in backends]
    for b in backends:
        gg.unregister_backend(b.spec.name)


def test_wrong_and_failing_backends_are_flagged_not_celebrated(tmp_path, capsys, bad_backends):
    out_json = tmp_path / "b.json"
    argv = ["--cases", "dsv3_down_ep8", "--ops", "fwd", "--splits", "skewed", "--backends", ",".join(bad_backends)]
    code, out, _ = _run(capsys, *argv, *SMOKE, "--out", str(out_json), "--quiet")
    assert code == 1
    rows = {r["backend"]: r for r in json.loads(out_json.read_text())["rows"]}
    wrong, raises = rows["bench_test_wrong"], rows["bench_test_raises"]
    assert wrong["status"] == "wrong" and wrong["sqnr_db"] < wrong["sqnr_floor_db"] and wrong["times_ms"]
    assert raises["status"] == "error" and "kernel exploded" in raises["note"]
    assert "WRONG" in out and "WRONG: bench_test_wrong" in out and "ERROR: bench_test_raises" in out
    wrong_line = next(line for line in out.splitlines() if "bench_test_wrong" in line and "WRONG" in line)
    assert f"{wrong['vs_peer']:.2f}" not in wrong_line  # no ratio shown for a wrong result


class _GpuOnly(_Raises):
    spec = gg.BackendSpec(
        name="bench_test_gpu_only", ops=frozenset({"fwd"}), recipes=frozenset({"bf16"}), vendors=frozenset({"cuda"})
    )


def test_named_backend_that_is_not_eligible_is_reported(capsys):
    gg.register_backend(_GpuOnly())
    try:
        argv = [
            "--cases",
            "qwen3_30b_down",
            "--ops",
            "fwd",
            "--splits",
            "balanced",
            "--backends",
            "bench_test_gpu_only",
        ]
        code, out, _ = _run(capsys, *argv, *SMOKE, "--no-peer", "--quiet", "--device", "cpu")
    finally:
        gg.unregister_backend("bench_test_gpu_only")
    assert code == 0
    assert "SKIPPED: bench_test_gpu_only" in out and "not eligible" in out and "[placement]" in out


def test_plot_without_matplotlib_says_so_and_still_writes_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plot.missing() == plot.MISSING
    png, out_json = tmp_path / "b.png", tmp_path / "b.json"
    argv = ["--cases", "mixtral_down", "--ops", "fwd", "--splits", "balanced", "--plot", str(png)]
    code, _, err = _run(capsys, *argv, *SMOKE, "--out", str(out_json), "--quiet")
    assert code == 0 and not png.exists() and out_json.exists()
    assert "needs matplotlib" in err and "pip install matplotlib" in err


def test_plot_is_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "b.png"
    argv = ["--cases", "mixtral_down", "--ops", "fwd,wgrad", "--splits", "balanced", "--plot", str(png)]
    code, out, _ = _run(capsys, *argv, *SMOKE, "--quiet")
    assert code == 0 and f"wrote {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ops", "fwd,bwd"], "ops='bwd'"),
        (["--splits", "uniform"], "splits='uniform'"),
        (["--recipe", "int8"], "recipe='int8'"),
        (["--backends", "ghost"], "backends='ghost'"),
        (["--cases", "nope"], "cases='nope'"),
        (["--scale", "2"], "scale=2.0"),
        (["--min-reps", "0"], "min-reps/max-reps"),
        (["--warmup-ms", "nan"], "warmup-ms=nan"),
    ],
)
def test_bad_arguments_name_the_value_and_what_is_allowed(capsys, argv, message):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "is invalid" in err


def test_json_record_has_no_nan_and_reports_ceiling_notes():
    c = ceilings.Ceilings(matmul_tflops={"bf16": 1.5}, copy_gbs=2.0, notes={"fp8": "not measured: x"})
    line = report.ceilings_line(c)
    assert "bf16 matmul 1.50 TFLOP/s" in line and "fp8 not measured: x" in line and "copy 2.00 GB/s" in line
    assert (
        report._sig(0.000123) == "0.000123" and report._sig(123456.0) == "123456" and report._sig(math.inf) == "exact"
    )


@pytest.mark.gpu
def test_gpu_smoke_run_times_with_events_and_checks_every_result(tmp_path, capsys):
    out_json = tmp_path / "b.json"
    argv = ["--cases", "qwen3_30b_gateup,mixtral_down", "--scale", "0.1", "--device", "cuda", "--quiet"]
    code, out, _ = _run(capsys, *argv, "--rep-ms", "5", "--out", str(out_json))
    assert code == 0, out
    doc = json.loads(out_json.read_text())
    assert doc["environment"]["device"]["type"] == "cuda" and doc["ceilings"]["matmul_tflops"]["bf16"] > 0
    timed = [r for r in doc["rows"] if r["status"] == "ok"]
    assert len([r for r in timed if r["role"] == "peer"]) == 12
    assert all(r["sqnr_db"] >= r["sqnr_floor_db"] and r["median_ms"] > 0 for r in timed)


class _WrongShape(_Raises):
    spec = _Raises.spec.model_copy(update={"name": "bench_test_wrong_shape"})

    def run(self, problem, inputs):
        return inputs.a[:, :1].clone()


def test_a_result_of_the_wrong_shape_is_an_error_not_a_crash(capsys):
    gg.register_backend(_WrongShape())
    try:
        argv = [
            "--cases",
            "mixtral_down",
            "--ops",
            "fwd",
            "--splits",
            "balanced",
            "--backends",
            "bench_test_wrong_shape",
        ]
        code, out, _ = _run(capsys, *argv, *SMOKE, "--no-peer", "--quiet")
    finally:
        gg.unregister_backend("bench_test_wrong_shape")
    assert code == 1
    # The core checks run()'s result against the problem before bench sees it.
    assert "ERROR: bench_test_wrong_shape" in out and "run() returned shape (164, 1), expected (164, 64)" in out


def test_prequantized_weights_reach_the_backend_and_are_checked_as_the_same_function(tmp_path, capsys):
    out_json = tmp_path / "p.json"
    argv = ["--cases", "mixtral_down", "--ops", "fwd,dgrad", "--splits", "skewed", "--recipe", "a16w4,mxfp8"]
    flags = ["--prequantized-weights", "--backends", "reference", "--quiet", "--out", str(out_json)]
    code, out, _ = _run(capsys, *argv, *SMOKE, *flags)
    assert code == 0, out
    rows = [r for r in json.loads(out_json.read_text())["rows"] if r["backend"] == "reference"]
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)
    floors = {r["recipe"]: r["sqnr_floor_db"] for r in rows}
    # a16w4: bf16 activations x the very MX weights passed, so the output floor applies;
    # mxfp8 still quantizes the activations inside, so only the recipe floor does.
    assert floors["a16w4"] == pytest.approx(45.16, abs=0.01) and floors["mxfp8"] == 25.0


def test_mx_weights_both_times_each_mx_call_per_call_and_prequantized(tmp_path, capsys):
    """``--mx-weights both``: MX fwd / dgrad run twice (bf16 weights quantized inside the
    call, then an MXTensor), labelled in the table and the JSON; wgrad and bf16 once."""
    out_json = tmp_path / "both.json"
    argv = ["--cases", "mixtral_down", "--ops", "fwd,dgrad,wgrad", "--splits", "balanced", "--recipe", "bf16,a16w4"]
    flags = ["--mx-weights", "both", "--backends", "reference", "--no-peer", "--quiet", "--out", str(out_json)]
    code, out, _ = _run(capsys, *argv, *SMOKE, *flags)
    assert code == 0, out
    doc = json.loads(out_json.read_text())
    seen = sorted((r["recipe"], r["op"], r["weights"]) for r in doc["rows"] if r["status"] == "ok")
    assert seen == sorted(
        [("bf16", op, "") for op in ("fwd", "dgrad", "wgrad")]
        + [("a16w4", op, w) for op in ("fwd", "dgrad") for w in ("per-call", "prequantized")]
        + [("a16w4", "wgrad", "")]
    )
    assert doc["options"]["mx_weights"] == "both"
    assert "a16w4 w:per-call" in out and "a16w4 w:prequantized" in out
    assert "= 8 problems (MX fwd/dgrad twice: --mx-weights both)" in out


def _row(backend: str, role: str, times: list[float], rounds: int = 1, **fields) -> runner.Row:
    median = sorted(times)[len(times) // 2]
    return runner.Row(
        case="c", groups=2, m=8, n=8, k=8, splits="balanced", op="fwd", recipe="bf16", weights="", backend=backend,
        role=role,
        status="ok", times_ms=times, round_medians_ms=[median] * rounds, median_ms=median, tflops=1.0, gbs=1.0,
        pct_of_ceiling=fields.pop("pct", 10.0), sqnr_db=60.0, **fields,
    )  # fmt: skip


def test_single_round_outliers_are_flagged_not_printed_as_facts():
    steady_peer = _row("torch._grouped_mm", "peer", [1.0, 1.1, 1.05])
    noisy = _row("noisy", "backend", [0.01, 1.0, 2.0], vs_peer=171.0)
    steady = _row("steady", "backend", [2.0, 2.1, 2.2], vs_peer=0.5)
    several_rounds = _row("rounds", "backend", [0.01, 1.0, 2.0], rounds=5, vs_peer=1.0)
    over_ceiling = _row("over", "backend", [1.0, 1.0], vs_peer=1.0, pct=250.0)
    rows = [steady_peer, noisy, steady, several_rounds, over_ceiling]
    assert [report.unreliable(r) for r in rows] == [False, True, False, False, False]
    lines = {
        r.backend: next(line for line in report.table(rows).splitlines() if f" {r.backend} " in line) for r in rows
    }
    assert "171.00?" in lines["noisy"] and "?" not in lines["steady"] and "?" not in lines["rounds"]
    assert "250.0?" in lines["over"]
    note = " ".join(report.reliability_note(rows))
    assert "1 of 5 rows" in note and "--rounds 5" in note and "1 rows exceed the measured ceiling" in note
    assert report.reliability_note([steady_peer, steady]) == []


def test_ineligible_summary_gives_each_reason_once_with_its_count():
    joined = "[recipe] recipe bf16 not supported; supports mxfp4; [arch] arch cpu not supported"
    items = [
        {"problem": "p1", "backend": "x", "reasons": "[recipe] recipe bf16 not supported; supports mxfp4"},
        {"problem": "p2", "backend": "x", "reasons": joined},
        {"problem": "p3", "backend": "x", "reasons": joined},
    ]
    lines = report.ineligible_summary(items)
    assert lines[0] == "x: not eligible for 3 problem(s):"
    assert lines[1:] == [
        "  [recipe] recipe bf16 not supported; supports mxfp4 (3)",
        "  [arch] arch cpu not supported (2)",
    ]


def test_cpu_ceilings_are_marked_as_orientation_and_fp8_as_emulated():
    c = ceilings.Ceilings(matmul_tflops={"bf16": 0.3, "fp8": 0.000129}, copy_gbs=2.0)
    line = report.ceilings_line(c, cpu=True)
    assert "fp8 matmul 0.000129 TFLOP/s (emulated by torch on the CPU)" in line and "orientation only" in line
    assert "emulated" not in report.ceilings_line(c)


def test_cpu_default_is_a_smoke_run_and_scale_1_is_full_size():
    from grouped_gemm.bench import command
    from grouped_gemm.cli import build_parser

    cpu = command.options(build_parser().parse_args(["bench", "--cases", "mixtral_down", "--device", "cpu"]))
    full = command.options(
        build_parser().parse_args(["bench", "--cases", "mixtral_down", "--device", "cpu", "--scale", "1"])
    )
    assert cpu.cases == tuple(shapes.select_cases("mixtral_down", 0.01))
    assert full.cases == tuple(shapes.select_cases("mixtral_down", 1.0)) and full.cases[0].m > 50 * cpu.cases[0].m


BENCHMARK_SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))


@pytest.fixture(scope="module")
def script_help() -> dict[str, tuple[int, str, str]]:
    """Each benchmark script's ``python benchmarks/<script> --help``: (exit status, stdout,
    stderr) by script name, each in a child of one process that imported torch, triton and
    grouped_gemm (what every script imports first) once, instead of a fresh Python each."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # some compile kernels
    programs = {script: [str(ROOT / "benchmarks" / script), "--help"] for script in BENCHMARK_SCRIPTS}
    return run_forked(programs, ["torch", "triton", "grouped_gemm"], env=env, timeout=120)


@pytest.mark.parametrize("script", BENCHMARK_SCRIPTS)
def test_every_benchmark_script_imports_and_parses_its_arguments(script, script_help):
    """``--help`` runs a script's imports and argument parser: a name moved in the library
    (``torch_device`` to ``tools``) broke benchmarks/autotune.py on the GPU host once."""
    path = ROOT / "benchmarks" / script
    status, stdout, stderr = script_help[script]
    assert status == 0, stderr[-2000:]
    if "argparse" in path.read_text():  # the others are modules of shared helpers
        assert "usage:" in stdout


def test_host_overhead_profile_writes_the_top_functions(tmp_path):
    """``host_overhead.py``'s helpers, on the CPU: the ``--profile`` writer's pstats tables
    (by own and by cumulative time), alternating calls, and ``--only``'s selection."""
    spec = importlib.util.spec_from_file_location("host_overhead", ROOT / "benchmarks" / "host_overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = tmp_path / "route.txt"
    module._profile(lambda: sorted(range(100), key=str), 20, path)
    text = path.read_text()
    assert "Ordered by: internal time" in text and "tottime" in text and "sorted" in text
    assert "Ordered by: cumulative time" in text
    seen = []
    call = module._alternating(lambda: seen.append("a"), lambda: seen.append("b"))
    for _ in range(5):
        call()
    assert seen == ["a", "b", "a", "b", "a"]
    variants = {"bare": 0, "gg a16w4 x": 1, "gg bf16 reused": 2, "gg mxfp8 y": 3}
    assert list(module.selected(variants, "a16w4, reused")) == ["bare", "gg a16w4 x", "gg bf16 reused"]
    assert list(module.selected(variants, "")) == list(variants)


def test_host_overhead_pairs_each_block_with_a_bare_block(tmp_path):
    """``paired_rows`` times a bare block right before every variant block and reads the
    variant's cost over bare from those pairs: a host that slows down between rounds (here
    +50 us a call from the second round on) moves both blocks of a pair alike, so the
    paired figure stays the variant's own +7 us while the unpaired medians drift."""
    spec = importlib.util.spec_from_file_location("host_overhead", ROOT / "benchmarks" / "host_overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    own = {"bare": 20.0, "gg": 27.0, "gg mx": 45.0}
    variants = {name: (lambda name=name: name) for name in own}
    log: list[str] = []

    def timer(fn, calls):
        name = fn()
        log.append(name)
        assert calls == 3
        drift = 50.0 if len(log) > 2 * len(own) else 0.0
        return own[name] + drift

    rows = module.paired_rows(variants, 3, 4, timer)
    assert [r["variant"] for r in rows] == ["bare", "gg", "gg mx"]
    assert all(log[i - 1] == "bare" for i, name in enumerate(log) if name != "bare")  # each after a bare block
    assert [r["over_bare_us"] for r in rows] == [0.0, 7.0, 25.0]
    assert [r["best_over_best_us"] for r in rows] == [0.0, 7.0, 25.0]
    assert rows[1]["host_us"] == 77.0  # the unpaired median: three of its four blocks ran slow


@pytest.mark.parametrize("command", ["bench", "tune"])
@pytest.mark.parametrize("seed", ["99999999999999999999", "1.5"])
def test_a_seed_torch_cannot_take_is_a_usage_error(command, seed, capsys):
    # A seed past 2**64 was taken by argparse and raised ValueError ("Overflow when unpacking
    # long long") from torch.Generator.manual_seed in the middle of the run, with a traceback.
    quick = ["--cases", "mixtral_down", "--ops", "fwd", "--splits", "balanced", "--recipe", "bf16", "--scale", "0.01"]
    with pytest.raises(SystemExit) as exited:
        main([command, *quick, "--device", "cpu", "--seed", seed])
    assert exited.value.code == 2
    assert f"argument --seed: invalid seed '{seed}'" in capsys.readouterr().err
