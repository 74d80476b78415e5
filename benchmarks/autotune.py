"""Autotuning on the MoE shapes: the tuned choice against the best backend timed separately.

For every case of ``moe_shapes.json`` x balanced / skewed splits x fwd / dgrad / wgrad, in
bf16 and in each MX recipe where at least two backends are eligible here, it

1. autotunes the problem in a fresh cache directory (the path of ``grouped-gemm tune``:
   one call on random operands with autotuning on) and records the choice, what
   declared priority would have picked, every contender's tuned time and the tuning cost;
2. times every eligible backend separately through the API (``backend=<name>``, strict),
   on operand sets rotated past the L2 cache, in rounds (``grouped_gemm.bench.timing``);
   where others are within the tuner's close band of the fastest (``CLOSE_MARGIN``, 15 %),
   those are timed again alternating in short blocks, as the tuner does (``interleave``,
   ``paired_ms``, with more calls than it), and that defines their times;
3. reports ``gap`` = time(tuned choice) / time(best) - 1 (the goal: <= 3 % on every
   problem), a choice with a kernel config timed as it is dispatched (``TUNED``: the API
   with autotuning on, after the tuning), not as its backend's default; and ``vs
   priority`` = time(priority choice) / time(tuned choice) - 1; and
   for each problem whether the tuner or the separate timing needed a close call and
   whether the tuned choice was measured on it or on the other splits of its signature
   (the splits are host lists: the signature holds M's bucket and the largest group's,
   so a skewed split is tuned apart from a balanced one unless both buckets agree).

Last, a fresh process calls the first problem again with the same cache directory and
must measure nothing (``tuned 0, loaded 1``). The run points ``GROUPED_GEMM_CACHE_DIR``
at a new temporary directory, so any compiled-kernel cache under that variable starts
cold too and first-call compilation shows in the tuning cost. Separate timings run each
backend's default ``run`` (the Triton backends' tile configs are timed by
``tile_sweep.py``). ``--quick`` (the H200 run, under 5 minutes) lightens the separate
timing, limits the MX recipes to ``mxfp4`` on four cases (unless ``--recipes`` names
them: then on ``--cases``) and stops starting problems after ``--budget-s``. On the H200 on
2026-12-03 it took 78 s for 96 problems; by that run's times, the close calls add about
1.5 s of tuning (9 signatures) and 8 s of separate interleaved timing (17 problems).
Writes ``<out>/autotune.json`` (``--out``, else ``$OUT``, else ``bench-results/``) and
prints the table last.

    python benchmarks/autotune.py --quick --out $OUT
    python benchmarks/autotune.py [--cases a,b] [--recipes bf16,mxfp4] [--ops fwd] [--scale 0.01]
    python benchmarks/autotune.py --scale 0.01 --device cpu --cases dsv3_gateup_ep8 --recipes bf16  # smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import grouped_gemm as gg
from grouped_gemm import autotune, tuning_store
from grouped_gemm.bench.operands import DTYPES, make_operands
from grouped_gemm.bench.shapes import SPLIT_KINDS, Case, parse_list, select_cases
from grouped_gemm.bench.timing import CALL_ERRORS, TimingPlan, median, time_in_rounds
from grouped_gemm.bench.tune import format_table, tune_one
from grouped_gemm.clock import Clock
from grouped_gemm.problem import OPS
from grouped_gemm.tools import torch_device

_API = {"fwd": gg.grouped_gemm, "dgrad": gg.grouped_gemm_dgrad, "wgrad": gg.grouped_gemm_wgrad}
MX_RECIPES = ("mxfp8", "mxfp4", "a8w4", "a16w4")
QUICK_MX = ("mxfp4",)
QUICK_MX_CASES = ("dsv3_gateup_ep8", "gptoss120b_gateup", "mixtral_down", "gptoss120b_gateup_decode")
GOAL_GAP = 0.03
#: The separate timing's label for the tuned dispatch (a choice with a kernel config).
TUNED = "(tuned)"
_FULL_PLAN = TimingPlan(warmup_ms=25.0, rep_ms=150.0, min_reps=10, max_reps=400, rounds=5)
_QUICK_PLAN = TimingPlan(warmup_ms=10.0, rep_ms=40.0, min_reps=5, max_reps=200, rounds=2)
_CPU_PLAN = TimingPlan(warmup_ms=1.0, rep_ms=5.0, min_reps=2, max_reps=10, rounds=1)
#: Close contenders timed interleaved: several times the tuner's calls (``CLOSE_PLAN``).
_FULL_CLOSE = autotune.ClosePlan(rep_ms=400.0, min_blocks=16, max_blocks=200)
_QUICK_CLOSE = autotune.ClosePlan(rep_ms=150.0, min_blocks=12, max_blocks=100)
_CPU_CLOSE = autotune.ClosePlan(rep_ms=5.0, min_blocks=2, max_blocks=4)


def separate_times(
    op: str,
    case: Case,
    kind: str,
    recipe: str,
    names: list[str],
    device: torch.device,
    plans: tuple[TimingPlan, autotune.ClosePlan],
    seed: int,
) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None]:
    """Ms of each named backend, or its error, on rotated operand sets: the median of
    rounds, and for those within ``CLOSE_MARGIN`` of the fastest their paired times
    from interleaved blocks (``rounds_ms`` keeps the rounds' median). Also what that
    close call took, None if there was none."""
    plan, close_plan = plans
    dtype = DTYPES[gg.get_recipe(recipe).plain_dtype or "bfloat16"]
    splits = case.splits(kind)
    sets = make_operands(op, case, splits, dtype, device, seed + 1)
    count = len(sets.sets)

    def call(name: str, offset: int = 0) -> Any:
        def run(i: int) -> Any:
            chosen = sets.sets[(offset + i) % count]
            if name == TUNED:
                with gg.use_backends(autotune=True):
                    return _API[op](chosen.a, chosen.b, splits, recipe=recipe)
            return _API[op](chosen.a, chosen.b, splits, recipe=recipe, backend=name)

        return run

    with gg.use_backends(strict=True, autotune=False):
        timed = time_in_rounds([call(n) for n in names], [count] * len(names), device, plan)
        measured = {
            n: ({"error": f"{type(t.error).__name__}: {t.error}"} if t.error else {"ms": median(t.times_ms)})
            for n, t in zip(names, timed, strict=True)
        }
        close = autotune.close_to_fastest({n: v["ms"] for n, v in measured.items() if "ms" in v})
        if not close:
            return measured, None
        record: dict[str, Any] = {"backends": close, "rounds_ms": {n: measured[n]["ms"] for n in close}}
        calls = [call(n, j * max(1, count // len(close))) for j, n in enumerate(close)]
        try:
            blocks, made = autotune.interleave(
                calls, max(record["rounds_ms"].values()), Clock(device.type == "cuda"), close_plan
            )
        except CALL_ERRORS as exc:  # the rounds stand
            return measured, {**record, "error": f"{type(exc).__name__}: {exc}"}
    for name, ms in zip(close, autotune.paired_ms(blocks, record["rounds_ms"][close[0]]), strict=True):
        measured[name] = {"ms": ms, "rounds_ms": measured[name]["ms"]}
    return measured, {**record, "calls": made}


def one_problem(
    op: str,
    case: Case,
    kind: str,
    recipe: str,
    device: torch.device,
    plans: tuple[TimingPlan, autotune.ClosePlan],
    seed: int,
) -> dict[str, Any] | None:
    """Tune, then time every eligible backend; None when fewer than two are eligible."""
    probe = gg.explain(
        op=op,
        recipe=recipe,
        groups=case.groups,
        m=case.m,
        n=case.n,
        k=case.k,
        splits=case.splits(kind),
    )
    eligible = [c.name for c in probe.candidates if c.eligible]
    if len(eligible) < 2:
        return None
    tuned_before = gg.dispatch_stats()["autotune"]["tuned"]
    decision = tune_one(op, case, kind, recipe, device, seed)
    measured_here = gg.dispatch_stats()["autotune"]["tuned"] > tuned_before
    tuning = decision.tuning
    timed = eligible + ([TUNED] if decision.config is not None else [])
    measured, close = separate_times(op, case, kind, recipe, timed, device, plans, seed)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # operand sizes vary by 100x between problems
    ok = {n: v["ms"] for n, v in measured.items() if "ms" in v}
    backends_ok = {n: ms for n, ms in ok.items() if n != TUNED}
    best = min(backends_ok, key=backends_ok.get) if backends_ok else None
    choice, prio = decision.selected, tuning.priority_choice if tuning else probe.selected
    choice_ms = ok.get(TUNED if decision.config is not None else choice)
    row = {
        "case": case.name,
        "splits": kind,
        "op": op,
        "recipe": recipe,
        "G": case.groups,
        "M": case.m,
        "N": case.n,
        "K": case.k,
        "choice": choice,
        "config": decision.config,
        "priority_choice": prio,
        "best": best,
        "tuned_ms": {t.label: t.ms for t in tuning.timings} if tuning else {},
        "tuned_notes": {t.label: t.note for t in tuning.timings if t.note} if tuning else {},
        "tuning_cost_ms": tuning.cost_ms if tuning else None,
        "tuned_here": measured_here,
        "tuned_close_call": dataclasses.asdict(tuning.close_call) if tuning and tuning.close_call else None,
        "separate": measured,
        "separate_close_call": close,
    }
    if best is not None and choice_ms is not None:
        row["gap"] = choice_ms / ok[best] - 1.0
    if choice_ms is not None and prio in ok:
        row["vs_priority"] = ok[prio] / choice_ms - 1.0
    return row


def reload_check(first: dict[str, Any], cache: str, args: argparse.Namespace) -> dict[str, Any]:
    """Call the first problem in a fresh process with the same cache: it must not measure."""
    env = {**os.environ, tuning_store.ENV_CACHE_DIR: cache}
    cmd = [sys.executable, __file__, "--child", "--cases", first["case"], "--splits", first["splits"]]
    cmd += ["--ops", first["op"], "--recipes", first["recipe"], "--scale", str(args.scale), "--device", args.device]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def child(args: argparse.Namespace, device: torch.device) -> int:
    case = select_cases(args.cases, args.scale)[0]
    decision = tune_one(args.ops, case, args.splits, args.recipes, device, args.seed)
    print(json.dumps({"selected": decision.selected, "autotune": gg.dispatch_stats()["autotune"]}))
    return 0


def notes(row: dict[str, Any]) -> str:
    """Close calls (``close:tune``, ``close:sep``) and a choice measured on other splits."""
    marks = [
        f"close:{side}" for side, key in (("tune", "tuned_close_call"), ("sep", "separate_close_call")) if row[key]
    ]
    if row["tuning_cost_ms"] is not None and not row["tuned_here"]:
        marks.append("tuned on other splits")
    return " ".join(marks)


def table(rows: list[dict[str, Any]]) -> str:
    out = [("case", "splits", "op", "recipe", "tuned", "priority", "best", "gap %", "vs prio %", "tune ms", "notes")]
    for r in rows:
        gap = r.get("gap")
        out.append(
            (
                r["case"],
                r["splits"],
                r["op"],
                r["recipe"],
                str(r["choice"]),
                str(r["priority_choice"]),
                str(r["best"]),
                "-" if gap is None else f"{100 * gap:.1f}" + (" !" if gap > GOAL_GAP else ""),
                "-" if r.get("vs_priority") is None else f"{100 * r['vs_priority']:.1f}",
                "-" if r["tuning_cost_ms"] is None else f"{r['tuning_cost_ms']:.0f}",
                notes(r),
            )
        )
    return format_table(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the < 5 min H200 run (see the module docstring)")
    p.add_argument("--cases", default="all")
    p.add_argument("--splits", default="balanced,skewed")
    p.add_argument("--ops", default="fwd,dgrad,wgrad")
    p.add_argument("--recipes", help="default: bf16 and every MX recipe (--quick: bf16, mxfp4)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply M, N, K (0.01: a CPU smoke run)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--budget-s", type=float, help="start no problem after this many seconds (--quick: 250)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench-results", help="directory of the JSON")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    device = torch_device(args.device)
    if args.child:
        return child(args, device)
    started = time.perf_counter()
    budget = args.budget_s if args.budget_s is not None else (250.0 if args.quick else float("inf"))
    recipes = parse_list(args.recipes, "recipes", tuple(gg.RECIPES)) if args.recipes else None
    recipes = recipes or (["bf16", *QUICK_MX] if args.quick else ["bf16", *MX_RECIPES])
    if device.type == "cpu":
        plans = (_CPU_PLAN, _CPU_CLOSE)
    else:
        plans = (_QUICK_PLAN, _QUICK_CLOSE) if args.quick else (_FULL_PLAN, _FULL_CLOSE)
    cache = tempfile.mkdtemp(prefix="gg-autotune-")
    os.environ[tuning_store.ENV_CACHE_DIR] = cache  # a fresh cache: every problem is measured
    jobs = [
        (case, kind, recipe, op)
        for recipe in recipes
        for case in select_cases(args.cases, args.scale)
        if recipe == "bf16" or not args.quick or args.recipes or case.name in QUICK_MX_CASES
        for kind in parse_list(args.splits, "splits", SPLIT_KINDS)
        for op in parse_list(args.ops, "ops", OPS)
    ]
    rows, skipped, not_run = [], [], []
    for i, (case, kind, recipe, op) in enumerate(jobs):
        label = f"{case.name} {kind} {recipe} {op}"
        if time.perf_counter() - started > budget:
            not_run.append(label)
            continue
        print(f"[{i + 1}/{len(jobs)}] {label}", file=sys.stderr, flush=True)
        row = one_problem(op, case, kind, recipe, device, plans, args.seed)
        if row is None:
            skipped.append(label)
        else:
            rows.append(row)
    check = reload_check(rows[0], cache, args) if rows else {}
    gaps = [r["gap"] for r in rows if "gap" in r]
    costs = [r["tuning_cost_ms"] for r in rows if r["tuned_here"]]  # once per signature
    misses = [r for r in rows if r.get("gap", 0.0) > GOAL_GAP]
    summary = {
        "problems": len(rows),
        "within_goal": sum(g <= GOAL_GAP for g in gaps),
        "worst_gap": max(gaps, default=None),
        "close_calls_tuned": sum(r["tuned_close_call"] is not None for r in rows if r["tuned_here"]),
        "close_calls_separate": sum(r["separate_close_call"] is not None for r in rows),
        "misses_tuned_on_other_splits": sum(not r["tuned_here"] for r in misses),
        "differs_from_priority": sum(r["choice"] != r["priority_choice"] for r in rows),
        "tuning_cost_ms": {"median": median(costs), "max": max(costs)} if costs else None,
        "second_process": check,
        "skipped_fewer_than_two_eligible": skipped,
        "not_run_budget": not_run,
        "seconds": time.perf_counter() - started,
    }
    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "quick": args.quick,
        "summary": summary,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "autotune.json").write_text(json.dumps(doc, indent=1))
    print(f"wrote {out / 'autotune.json'}")
    differs = [r for r in rows if r["choice"] != r["priority_choice"]]
    if differs:
        print("\nwhere the tuned choice differs from declared priority:")
        print(table(differs))
    print(
        f"\n{summary['within_goal']}/{len(gaps)} within {100 * GOAL_GAP:.0f} % of the best "
        f"(worst {100 * (summary['worst_gap'] or 0):.1f} %; {summary['misses_tuned_on_other_splits']} of the "
        f"{len(misses)} misses tuned on other splits); {summary['differs_from_priority']} differ from priority; "
        f"close calls: {summary['close_calls_tuned']} signature(s) in tuning, {summary['close_calls_separate']} "
        f"problem(s) timed again interleaved separately; "
        f"tuning cost per signature ms {summary['tuning_cost_ms']}; second process {check.get('autotune', check)}; "
        f"{len(skipped)} skipped (< 2 eligible), {len(not_run)} not run (budget); {summary['seconds']:.0f} s"
    )
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
