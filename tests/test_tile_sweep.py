"""benchmarks/tile_sweep.py: its pure helpers, and one sweep end to end in Triton's interpreter
(the script itself needs a GPU; here the backends are made to offer their GPU configs, cut
to two, for CPU tensors)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from grouped_gemm.backends.triton_mx import launch
from grouped_gemm.bench.operands import make_operands
from grouped_gemm.bench.shapes import Case
from grouped_gemm.bench.timing import TimingPlan

_spec = importlib.util.spec_from_file_location(
    "tile_sweep", Path(__file__).resolve().parents[1] / "benchmarks" / "tile_sweep.py"
)
tile_sweep = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("tile_sweep", tile_sweep)  # dataclasses look their module up
_spec.loader.exec_module(tile_sweep)

needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or not launch.interpreted(), reason="CPU tests run the kernels in Triton's interpreter"
)


def test_variants_follow_ops_and_backends():
    chosen = tile_sweep.variants(["wgrad", "fwd"], ["triton_grouped", "triton_mxfp8"])
    assert [(op, v.label) for op, v in chosen] == [
        ("fwd", "triton_grouped/bf16"),
        ("fwd", "triton_mxfp8/mxfp8"),
        ("wgrad", "triton_grouped/bf16"),
        ("wgrad", "triton_grouped/bf16 +=fp32"),
        ("wgrad", "triton_mxfp8/mxfp8 +=fp32"),
    ]
    assert not any(v.recipe == "a16w4" for op, v in tile_sweep.variants(["wgrad"], ["triton_mxfp4"]))


def test_summarize_picks_the_fastest_timed_config():
    s = tile_sweep.summarize([2.0, None, 1.0, 1.5], peer_ms=1.5)
    assert (s["best"], s["best_ms"], s["speedup"], s["x_peer"], s["default_x_peer"]) == (2, 1.0, 2.0, 1.5, 0.75)
    assert tile_sweep.summarize([None, None], peer_ms=1.0)["best"] is None
    assert tile_sweep.summarize([None, 3.0], peer_ms=None)["speedup"] is None  # the default failed to time
    assert tile_sweep.summarize([2.2, 1.0], peer_ms=1.0, control_ms=2.0)["default_x_control"] == pytest.approx(1.1)


def test_table_has_a_line_per_sweep_and_shows_errors():
    ok = {"case": "c", "splits": "balanced", "op": "fwd", "variant": "triton_grouped/bf16", "peer_ms": 1.0}
    ok |= {"configs": [{"config": {"bm": 64}}, {"config": {"bm": 128}}]}
    ok |= tile_sweep.summarize([2.0, 1.0], peer_ms=1.0, control_ms=1.6)
    bad = {"case": "c", "splits": "skewed", "op": "wgrad", "variant": "x", "error": "no configs offered"}
    lines = tile_sweep.table([ok, bad]).splitlines()
    assert len(lines) == 4
    assert "| bm=128 | 1.000 | 2.00 | 0.50 / 1.00 | 1.25 |" in lines[2]
    assert "no configs offered" in lines[3]


def test_without_a_gpu_it_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert tile_sweep.main(["--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@needs_interpreter
@pytest.mark.parametrize(
    ("op", "variant", "prequantized"),
    [
        ("fwd", tile_sweep.VARIANTS[0], False),
        ("wgrad", tile_sweep.VARIANTS[-1], False),
        ("dgrad", tile_sweep.VARIANTS[2], True),
    ],
    ids=["grouped_fwd", "mxfp8_wgrad_accumulate", "a16w4_dgrad_prequantized"],
)
def test_one_sweep_checks_and_times_every_config(op, variant, prequantized, monkeypatch):
    monkeypatch.setattr(launch, "offered", lambda problem, space: [dataclasses.asdict(c) for c in space[:2]])
    case = Case("tiny", 3, 40, 64, 64)
    sets = make_operands(op, case, [7, 0, 33], torch.bfloat16, torch.device("cpu"), 0)
    plan = TimingPlan(warmup_ms=0.0, rep_ms=0.0, min_reps=1, max_reps=1, rounds=1)
    row = tile_sweep.sweep(case, "skewed", op, variant, sets, torch.device("cpu"), plan, prequantized)
    assert "error" not in row, row.get("error")
    assert row["variant"].endswith(" w:prequantized") == prequantized
    assert all(type(s.b) is torch.Tensor for s in sets.sets), "the caller's bf16 sets are left as they were"
    assert len(row["configs"]) == 2 and all(e["ms"] > 0 and e["rel_vs_default"] < 1e-2 for e in row["configs"])
    assert row["peer_ms"] > 0 and row["best"] in (0, 1) and row["speedup"] >= 1.0
