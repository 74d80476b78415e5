"""``grouped-gemm tune``: pre-tune the MoE cases (or show what is stored) for autotuning.

Each selected (case, splits, recipe, op) is called once through the public API inside a
``use_backends(autotune=True)`` scope on random operands: a signature already stored for
this device and software is loaded, any other is measured and persisted. The table
shows the choice against the declared-priority choice, each contender's time (and
whether a close call needed interleaved timing) and what tuning cost. ``--show`` prints every stored file instead.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
from typing import Any

import torch

import grouped_gemm as gg
from grouped_gemm import autotune, tuning_store
from grouped_gemm.bench.operands import DTYPES, operand_shapes
from grouped_gemm.bench.shapes import CPU_SCALE, SPLIT_KINDS, Case, default_scale, parse_list, select_cases
from grouped_gemm.problem import OPS, Op
from grouped_gemm.tools import add_device_option, add_seed_option, torch_device

_API = {"fwd": gg.grouped_gemm, "dgrad": gg.grouped_gemm_dgrad, "wgrad": gg.grouped_gemm_wgrad}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cases", default="all", help="'all' or comma-separated case names of moe_shapes.json")
    p.add_argument("--ops", default="fwd,dgrad,wgrad", help="comma-separated: fwd, dgrad, wgrad")
    p.add_argument("--splits", default="balanced,skewed", help="comma-separated: balanced, skewed")
    p.add_argument("--recipe", default="bf16", help=f"comma-separated recipes: {', '.join(gg.RECIPES)}")
    p.add_argument("--scale", type=float, help=f"multiply M, N, K (default 1 on a GPU, {CPU_SCALE} on the CPU)")
    add_device_option(p)
    add_seed_option(p)
    p.add_argument("--show", action="store_true", help="print the stored choices instead of tuning")


def operands(op: Op, case: Case, kind: str, recipe: str, device: torch.device, seed: int) -> tuple[Any, Any, list]:
    """(a, b, splits) of one problem: random normal data, weights scaled by 1/sqrt(K)."""
    dtype = DTYPES[gg.get_recipe(recipe).plain_dtype or "bfloat16"]
    gen = torch.Generator(device=device).manual_seed(seed)
    a_shape, b_shape = operand_shapes(op, case)
    a = torch.randn(a_shape, dtype=dtype, device=device, generator=gen)
    b = torch.randn(b_shape, dtype=dtype, device=device, generator=gen)
    if op != "wgrad":
        b.mul_(1.0 / math.sqrt(case.k))
    return a, b, case.splits(kind)


def tune_one(op: Op, case: Case, kind: str, recipe: str, device: torch.device, seed: int) -> gg.Decision:
    """Call one problem once with autotuning on; its decision (with the tuning, unless
    fewer than two contenders were eligible)."""
    a, b, splits = operands(op, case, kind, recipe, device, seed)
    with gg.use_backends(autotune=True):
        _API[op](a, b, splits, recipe=recipe)
        decision = gg.explain(a, b, splits, op=op, recipe=recipe)
    del a, b
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return decision


def times_cell(tuning: tuning_store.Tuning | None) -> str:
    """``name ms`` per contender; pruned ones marked ``~``, excluded ones ``x``; after a
    close call, ``(close call +N calls)``."""
    if tuning is None:
        return "-"
    cells = []
    for t in tuning.timings:
        if t.ms is None:
            cells.append(f"{t.label} x")
        else:
            cells.append(f"{t.label} {'~' if t.note else ''}{t.ms:.4g}")
    close = f" (close call +{tuning.close_call.calls} calls)" if tuning.close_call else ""
    return " | ".join(cells) + close


def format_table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _tune(args: argparse.Namespace) -> int:
    device = torch_device(args.device)
    cases = select_cases(args.cases, default_scale(args.scale, device.type == "cpu"))
    ops = parse_list(args.ops, "ops", OPS)
    kinds = parse_list(args.splits, "splits", SPLIT_KINDS)
    recipes = parse_list(args.recipe, "recipe", tuple(gg.RECIPES))
    rows = [("case", "splits", "op", "recipe", "choice", "priority", "ms per contender", "tuning ms", "")]
    for case in cases:
        for kind in kinds:
            for recipe in recipes:
                for op in ops:
                    d = tune_one(op, case, kind, recipe, device, args.seed)
                    t = d.tuning
                    choice = d.selected or "none"
                    if d.config is not None:
                        choice = tuning_store.Timing(choice, d.config, None, 0).label
                    rows.append(
                        (
                            case.name,
                            kind,
                            op,
                            recipe,
                            choice,
                            t.priority_choice if t else "-",
                            times_cell(t),
                            f"{t.cost_ms:.1f}" if t else "-",
                            t.origin if t else "nothing to tune",
                        )
                    )
                    print(f"  {case.name} {kind} {recipe} {op}: {choice}", file=sys.stderr)
    stats = gg.dispatch_stats()["autotune"]
    print(format_table(rows))
    print(
        f"tuned {stats['tuned']} signature(s) in {stats['tuning_ms'] / 1e3:.1f} s ({stats['calls']} calls; "
        f"{stats['close_calls']} close call(s)), loaded {stats['loaded']}; stored in {tuning_store.cache_root()}"
    )
    return 0


def _show() -> int:
    files = tuning_store.stored_files()
    if not files:
        print(f"no autotune choices stored under {tuning_store.cache_root()}")
        return 0
    here = gg.describe_problem(groups=1, m=1, n=1, k=1).device
    current = autotune.TUNER.file_for(here) if here.detected else None
    for path in files:
        header, entries = tuning_store.read_any(path)
        versions = header.get("versions", {})
        mark = "  (this machine, loaded now)" if path == current else ""
        print(
            f"\n{path.name}{mark}\n  device {header.get('device')} {header.get('arch')}, "
            f"torch {versions.get('torch')}, triton {versions.get('triton')}, {len(entries)} choice(s)"
        )
        rows = [("problem", "choice", "priority", "ms per contender", "tuning ms", "measured")]
        for t in sorted(entries.values(), key=lambda e: e.problem):
            choice = tuning_store.Timing(t.choice, t.config, None, 0).label
            rows.append((t.problem, choice, t.priority_choice, times_cell(t), f"{t.cost_ms:.1f}", t.measured_at))
        if entries:
            print(format_table(rows))
    return 0


def run_command(args: argparse.Namespace) -> int:
    """``grouped-gemm tune``."""
    return _show() if args.show else _tune(args)
