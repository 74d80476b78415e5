"""GPU benchmark of MX training as it runs: a GroupedLinear step with fresh weights every step.

A step is ``GroupedLinear`` forward + backward (dgrad and wgrad) + an in-place SGD update,
with ``m_splits`` on the device, so every MX step re-quantizes the master weights it just
updated (forward along K, dgrad along N). Per case of ``grouped_gemm/bench/moe_shapes.json``
(default: the three gate-up cases the MX issue names) every recipe gets its own layer;
the recipes are timed in turn over several rounds (who goes first rotates), each timing a
few back-to-back steps between two CUDA events, and the report is the median step time
per recipe and its ratio to bf16. ``--graphs`` captures the whole step (fwd + bwd + SGD)
in a CUDA graph after a warm-up and times graph replays instead; a recipe with an op no
capturable backend runs is reported as such.

A second table, per case and weight format, times weight preparation on the forward
problem with an a16w4 call (E2M1 weights) and an mxfp8 call (E4M3): ``gg.quantize_mx_weight``
alone; the call with a cached pre-quantized MXTensor; the same call with the bf16 weights
(quantized inside the call); and ``torch._grouped_mm`` in bf16. The issue's goal is
``fresh <= cached + 1.5 x quantize``; the last column is ``(fresh - cached) / quantize``.
The ``fused prep`` columns time the Triton backends' quantize-and-lay-out kernel alone, for
fwd (blocks along K) and dgrad (along N); ``--prep-sweep`` times it for every tile of
``PREP_TILES`` too (in the JSON).

    python benchmarks/train_step.py [--quick] [--graphs] [--out DIR]

Writes ``DIR/train_step.json`` (every round's figures, the backends each recipe ran on,
the environment) and prints the short table last. Sized to finish in under 4 minutes on
one H200 (``--quick``: about a minute).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton

import grouped_gemm as gg
from grouped_gemm.bench.shapes import Case, select_cases
from grouped_gemm.bench.timing import back_to_back_ms

try:  # the built-in Triton backends' weight layouts (for the fused-prep columns)
    from grouped_gemm.backends.triton_mx import layouts
except ImportError:
    layouts = None

CASES = "dsv3_gateup_ep8,qwen3_30b_gateup,gptoss120b_gateup"
RECIPES = ("bf16", "mxfp4", "a16w4", "a8w4", "mxfp8")
LR = 1e-4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=CASES, help=f"comma-separated case names (default {CASES})")
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipes; bf16 is always timed")
    p.add_argument("--splits", choices=("balanced", "skewed"), default="balanced")
    p.add_argument("--rounds", type=int, help="rounds over the recipes (default 5, --quick 3)")
    p.add_argument("--steps", type=int, help="back-to-back steps timed per recipe and round (default 5, --quick 2)")
    p.add_argument("--graphs", action="store_true", help="time CUDA-graph replays of the captured step")
    p.add_argument("--quick", action="store_true", help="fewer rounds and steps, shorter weight-prep timing")
    p.add_argument("--no-prep", action="store_true", help="skip the weight-preparation table")
    p.add_argument("--profile", action="store_true", help="GPU time per kernel of one step per recipe")
    p.add_argument(
        "--prep-sweep", action="store_true", help="also time every tile of the fused prep kernel (sm_90 upcast path)"
    )
    p.add_argument("--out", type=Path, help="directory for train_step.json")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 5)
    args.steps = args.steps or (2 if args.quick else 5)
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in recipes if r not in gg.RECIPES]
    if unknown:
        p.error(f"--recipes: unknown {unknown}; known: {', '.join(gg.RECIPES)}")
    args.recipes = ["bf16"] + [r for r in recipes if r != "bf16"]
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be at least 1")
    return args


class Trainer:
    """One recipe's layer, optimizer and step on a case (static inputs, device splits)."""

    def __init__(self, recipe: str, case: Case, x: torch.Tensor, dy: torch.Tensor, splits: torch.Tensor) -> None:
        self.recipe = recipe
        self.layer = gg.GroupedLinear(case.groups, case.k, case.n, bias=False, recipe=recipe, device=x.device)
        self.optimizer = torch.optim.SGD(self.layer.parameters(), lr=LR)
        self.x = x.detach().clone().requires_grad_()
        self.dy = dy
        self.splits = splits
        self.graph: torch.cuda.CUDAGraph | None = None
        self.backends: dict[str, int] = {}
        self.error: str | None = None

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.x.grad = None
        self.layer(self.x, self.splits).backward(self.dy)
        self.optimizer.step()

    def warm_up(self, graphs: bool) -> None:
        """Compile kernels, record which backends ran, and capture the step for ``--graphs``."""
        gg.reset_dispatch_stats()
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.step()
            torch.cuda.current_stream().wait_stream(side)
            self.backends = dict(gg.dispatch_stats()["selected"])
            if graphs:
                # Gradients must be None at capture so the graph allocates them (and SGD
                # updates the weights in place inside it); every replay then rewrites them.
                self.optimizer.zero_grad(set_to_none=True)
                self.x.grad = None
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self.layer(self.x, self.splits).backward(self.dy)
                    self.optimizer.step()
                self.graph = graph
        except (gg.GroupedGemmError, RuntimeError) as exc:
            self.error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        torch.cuda.synchronize()

    def run(self, steps: int) -> None:
        for _ in range(steps):
            if self.graph is not None:
                self.graph.replay()
            else:
                self.step()


def train_steps(case: Case, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Median step time per recipe on one case, recipes interleaved in rounds."""
    gen = torch.Generator("cuda").manual_seed(0)  # on the GPU: a CPU randn of these takes seconds
    splits = case.splits(args.splits)
    x = torch.randn(case.m, case.k, generator=gen, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(case.m, case.n, generator=gen, device="cuda", dtype=torch.bfloat16) * 1e-2
    device_splits = torch.tensor(splits, device="cuda")
    trainers = [Trainer(r, case, x, dy, device_splits) for r in args.recipes]
    for t in trainers:
        t.warm_up(args.graphs)
    live = [t for t in trainers if t.error is None]
    rounds: dict[str, list[float]] = {t.recipe: [] for t in live}
    for r in range(args.rounds if live else 0):
        first = r % len(live)
        for t in live[first:] + live[:first]:
            rounds[t.recipe].append(back_to_back_ms(lambda t=t: t.run(1), args.steps))
    bf16 = statistics.median(rounds["bf16"]) if "bf16" in rounds else None
    kernels = {t.recipe: kernel_times(t) for t in live} if args.profile else {}
    rows = []
    for t in trainers:
        ms = statistics.median(rounds[t.recipe]) if t.recipe in rounds else None
        rows.append(
            {
                "case": case.name,
                "recipe": t.recipe,
                "mode": "graph replay" if args.graphs else "eager",
                "median_ms": ms,
                "vs_bf16": ms / bf16 if ms and bf16 else None,
                "round_ms": rounds.get(t.recipe, []),
                "backends": t.backends,
                "error": t.error,
                "kernels_ms": kernels.get(t.recipe),
            }
        )
    return rows


def kernel_times(trainer: Trainer) -> dict[str, float]:
    """GPU ms per kernel name over one step (torch profiler), largest first."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        trainer.run(1)
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            totals[event.name] = totals.get(event.name, 0.0) + event.time_range.elapsed_us() / 1e3
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def kernel_lines(rows: list[dict[str, Any]], top: int = 8) -> list[str]:
    """``--profile``: the largest kernels of one step per case and recipe."""
    lines = []
    for r in rows:
        if r.get("kernels_ms"):
            total = sum(r["kernels_ms"].values())
            lines.append(f"{r['case']} {r['recipe']}: {total:.2f} ms of kernels in one step")
            for name, ms in list(r["kernels_ms"].items())[:top]:
                lines.append(f"  {ms:8.3f} ms {100 * ms / total:5.1f} %  {name[:110]}")
    return lines


def bench_ms(fn: Callable[[], Any], quick: bool) -> float:
    return triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 100, return_mode="median")


def weight_prep(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    """Forward with fresh against cached weights, per weight format (a16w4: E2M1, mxfp8:
    E4M3): quantize alone, cached MXTensor, fresh bf16 weights, the fused prep kernel per op
    (and per tile with ``--prep-sweep``); and the bf16 peer."""
    gen = torch.Generator("cuda").manual_seed(1)
    splits = case.splits(args.splits)
    x = torch.randn(case.m, case.k, generator=gen, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(case.groups, case.n, case.k, generator=gen, device="cuda", dtype=torch.bfloat16)
    device_splits = torch.tensor(splits, device="cuda")
    offs = torch.cumsum(device_splits, 0, dtype=torch.int32)
    row: dict[str, Any] = {"case": case.name}
    calls = {"torch._grouped_mm bf16": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)}
    for fmt, recipe in PREP_FORMATS.items():
        w_mx = gg.quantize_mx_weight(w, fmt, op="fwd")
        calls |= {
            f"quantize_mx_weight {fmt}": lambda fmt=fmt: gg.quantize_mx_weight(w, fmt, op="fwd"),
            f"{recipe} cached MXTensor": lambda w_mx=w_mx, r=recipe: gg.grouped_gemm(x, w_mx, device_splits, recipe=r),
            f"{recipe} fresh bf16": lambda r=recipe: gg.grouped_gemm(x, w, device_splits, recipe=r),
        }
    for name, fn in calls.items():
        try:
            row[name] = bench_ms(fn, args.quick)
        except (gg.GroupedGemmError, RuntimeError) as exc:
            row[name] = None
            row[f"{name} error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    for fmt, recipe in PREP_FORMATS.items():
        for op in ("fwd", "dgrad"):
            row[f"fused prep {fmt} {op}"] = _fused_prep_ms(w, op, fmt, None, args.quick)
            if args.prep_sweep:
                row[f"fused prep {fmt} {op} sweep"] = {
                    f"{rows}x{warps}": _fused_prep_ms(w, op, fmt, (rows, warps), args.quick)
                    for rows, warps in PREP_TILES
                }
        q, cached, fresh = (
            row[f"quantize_mx_weight {fmt}"],
            row[f"{recipe} cached MXTensor"],
            row[f"{recipe} fresh bf16"],
        )
        row[f"{recipe} prep / quantize"] = (fresh - cached) / q if None not in (q, cached, fresh) else None
    return row


#: Weight formats of the prep table and the recipe whose forward times them.
PREP_FORMATS = {"e2m1": "a16w4", "e4m3": "mxfp8"}
#: (layout rows per program, warps) tried by ``--prep-sweep``.
PREP_TILES = [(rows, warps) for rows in (16, 32, 64, 128) for warps in (2, 4, 8)]


def _fused_prep_ms(w: torch.Tensor, op: str, fmt: str, tile: tuple[int, int] | None, quick: bool) -> float | None:
    """The fused quantize-and-layout kernel alone (None where it cannot run)."""
    if layouts is None:
        return None
    return bench_ms(lambda: layouts.quantize_upcast_weight(w, op, "rceil", fmt=fmt, tile=tile), quick)


def _cell(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def step_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| case | recipe | mode | step ms (median) | vs bf16 | backends / note |", "|---|---|---|---|---|---|"]
    for r in rows:
        note = r["error"] or ", ".join(f"{k} x{v}" for k, v in sorted(r["backends"].items()))
        lines.append(
            f"| {r['case']} | {r['recipe']} | {r['mode']} | {_cell(r['median_ms'])} | {_cell(r['vs_bf16'])}x | {note} |"
        )
    return "\n".join(lines)


def prep_table(rows: list[dict[str, Any]]) -> str:
    """One line per case and weight format."""
    head = "| case | format | bf16 peer | quantize | fused prep fwd | fused prep dgrad | cached MXTensor call"
    head += " | fresh bf16 call | (fresh - cached) / quantize |"
    lines = [head, "|---" * 9 + "|"]
    for r in rows:
        for fmt, recipe in PREP_FORMATS.items():
            cells = [r.get("torch._grouped_mm bf16"), r.get(f"quantize_mx_weight {fmt}")]
            cells += [r.get(f"fused prep {fmt} {op}") for op in ("fwd", "dgrad")]
            cells += [r.get(f"{recipe} cached MXTensor"), r.get(f"{recipe} fresh bf16")]
            body = " | ".join(_cell(c, 3) for c in cells)
            lines.append(f"| {r['case']} | {fmt} ({recipe}) | {body} | {_cell(r.get(f'{recipe} prep / quantize'))} |")
    return "\n".join(lines)


def sweep_lines(rows: list[dict[str, Any]]) -> list[str]:
    """``--prep-sweep``: the fastest tile per case, format and op against the default, then
    every tile's ms (the text is what comes back when the JSON cannot)."""
    lines = []
    for r in rows:
        for fmt in PREP_FORMATS:
            for op in ("fwd", "dgrad"):
                sweep = r.get(f"fused prep {fmt} {op} sweep")
                if sweep:
                    best = min(sweep, key=lambda t: sweep[t] if sweep[t] is not None else float("inf"))
                    lines.append(
                        f"fused prep {fmt} {op} on {r['case']}: fastest tile {best} {_cell(sweep[best], 3)} ms; "
                        f"default {_cell(r[f'fused prep {fmt} {op}'], 3)} ms"
                    )
                    lines.append("  " + " ".join(f"{tile} {_cell(ms, 3)}" for tile, ms in sweep.items()))
    return lines


def short_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """Step ratio to bf16, one line per case, one column per recipe."""
    mode = "graph replay" if args.graphs else "eager"
    lines = [
        f"step time / bf16 step time ({mode}; bf16 column: ms)",
        "case".ljust(22) + "".join(r.rjust(9) for r in args.recipes),
    ]
    for case in dict.fromkeys(r["case"] for r in rows):
        by = {r["recipe"]: r for r in rows if r["case"] == case}
        cells = []
        for recipe in args.recipes:
            r = by.get(recipe)
            value = r and (r["median_ms"] if recipe == "bf16" else r["vs_bf16"])
            cells.append(("-" if value is None else f"{value:.2f}").rjust(9))
        lines.append(case.ljust(22) + "".join(cells))
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "grouped_gemm": gg.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("train_step.py needs a CUDA GPU", file=sys.stderr)
        return 2
    cases = select_cases(args.cases)
    started = time.perf_counter()
    steps, preps = [], []
    for case in cases:
        print(f"{case.name}: G={case.groups} M={case.m} N={case.n} K={case.k}", flush=True)
        steps += train_steps(case, args)
        if not args.no_prep:
            preps.append(weight_prep(case, args))
        torch.cuda.empty_cache()
    elapsed = time.perf_counter() - started
    print()
    print(step_table(steps))
    for line in kernel_lines(steps):
        print(line)
    if preps:
        print()
        print(prep_table(preps))
        for line in sweep_lines(preps):
            print(line)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        doc = {
            "environment": environment(),
            "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "lr": LR,
            "steps": steps,
            "weight_prep": preps,
            "elapsed_s": elapsed,
        }
        path = args.out / "train_step.json"
        path.write_text(json.dumps(doc, indent=2), encoding="utf-8")
        print(f"\nwrote {path}")
    print(f"\nfinished in {elapsed:.0f} s")
    print(short_table(steps, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
