"""``grouped-gemm bench``: its arguments, and the run from them to table, JSON and plot.

Exit status: 0 when every timed backend ran and passed its accuracy check, 1 when any
result was wrong or a backend raised (the table and JSON are written either way).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

import grouped_gemm as gg
from grouped_gemm.bench import ceilings, environment, plot, report
from grouped_gemm.bench.runner import MX_WEIGHTS, BenchOptions, Sweep
from grouped_gemm.bench.shapes import CPU_SCALE, SPLIT_KINDS, default_scale, parse_list, select_cases
from grouped_gemm.bench.timing import TimingPlan
from grouped_gemm.errors import InvalidArgumentError
from grouped_gemm.problem import OPS
from grouped_gemm.tools import Progress, add_device_option, add_seed_option, torch_device

# A GPU sweep's defaults keep the 72-problem bf16 sweep within a few minutes on an H200;
# the CPU defaults keep a smoke run within seconds.
_GPU_PLAN = TimingPlan(warmup_ms=25.0, rep_ms=150.0, min_reps=10, max_reps=400, rounds=5)
_CPU_PLAN = TimingPlan(warmup_ms=2.0, rep_ms=20.0, min_reps=3, max_reps=20, rounds=1)
#: MX recipes on a CPU run Triton kernels in its interpreter, minutes per problem with many
#: groups, so a CPU run without --cases takes one case with few groups.
_CPU_MX_CASES = "mixtral_down"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cases",
        help=f"'all' (the default; on the CPU with an MX recipe: {_CPU_MX_CASES}) or comma-separated case names of "
        "moe_shapes.json",
    )
    p.add_argument("--ops", default="fwd,dgrad,wgrad", help="comma-separated: fwd, dgrad, wgrad")
    p.add_argument("--splits", default="balanced,skewed", help="comma-separated: balanced, skewed")
    p.add_argument("--recipe", default="bf16", help=f"comma-separated recipes: {', '.join(gg.RECIPES)}")
    p.add_argument(
        "--backends",
        default="eligible",
        help="'eligible' (every eligible backend except the slow reference), 'all', or comma-separated names",
    )
    p.add_argument("--scale", type=float, help=f"multiply M, N, K (default 1 on a GPU, {CPU_SCALE} on the CPU)")
    p.add_argument(
        "--rows-per-group",
        help="comma-separated token counts per expert: run each case at M = count x G instead of its own M",
    )
    add_device_option(p)
    p.add_argument("--warmup-ms", type=float, help="warm-up before a backend's first block, ms (GPU 25, CPU 2)")
    p.add_argument("--rep-ms", type=float, help="timed calls per backend and problem, in ms (GPU default 150, CPU 20)")
    p.add_argument("--min-reps", type=int, help="at least this many timed calls (GPU default 10, CPU 3)")
    p.add_argument("--max-reps", type=int, help="at most this many timed calls (GPU default 400, CPU 20)")
    p.add_argument("--rounds", type=int, help="blocks per backend, taken in turn with the others (GPU 5, CPU 1)")
    p.add_argument("--no-verify", action="store_true", help="skip the accuracy check of each output")
    p.add_argument("--no-peer", action="store_true", help="do not time torch._grouped_mm")
    p.add_argument(
        "--mx-weights",
        choices=MX_WEIGHTS,
        default="per-call",
        help="MX fwd/dgrad weights: bf16 quantized inside each call (training), gg.MXTensor, or both",
    )
    p.add_argument("--prequantized-weights", action="store_true", help="same as --mx-weights prequantized")
    p.add_argument("--device-splits", action="store_true", help="pass m_splits as a device tensor")
    add_seed_option(p)
    p.add_argument("--out", type=Path, help="write the JSON record here")
    p.add_argument("--plot", type=Path, help="write a PNG plot here (needs matplotlib)")
    p.add_argument("--markdown", type=Path, help="write a Markdown table for docs/performance.md here")
    p.add_argument("--commit", help="git commit to record when the tree has no .git (e.g. a copied checkout)")
    p.add_argument("--quiet", action="store_true", help="no progress line on stderr")


def _plan(args: argparse.Namespace, device: torch.device) -> TimingPlan:
    base = _GPU_PLAN if device.type == "cuda" else _CPU_PLAN
    plan = TimingPlan(
        warmup_ms=base.warmup_ms if args.warmup_ms is None else args.warmup_ms,
        rep_ms=base.rep_ms if args.rep_ms is None else args.rep_ms,
        min_reps=base.min_reps if args.min_reps is None else args.min_reps,
        max_reps=base.max_reps if args.max_reps is None else args.max_reps,
        rounds=base.rounds if args.rounds is None else args.rounds,
    )
    for name in ("warmup_ms", "rep_ms"):  # inf would be a call count int() cannot hold
        if not 0 <= getattr(plan, name) < math.inf:
            raise InvalidArgumentError(name.replace("_", "-"), getattr(plan, name), "a finite number >= 0")
    if plan.min_reps < 1 or plan.max_reps < plan.min_reps:
        raise InvalidArgumentError("min-reps/max-reps", (plan.min_reps, plan.max_reps), "1 <= min-reps <= max-reps")
    if plan.rounds < 1:
        raise InvalidArgumentError("rounds", plan.rounds, "an integer >= 1")
    return plan


def _backends(value: str) -> str | tuple[str, ...]:
    if value.strip() in ("eligible", "all"):
        return value.strip()
    known = tuple(b.name for b in gg.list_backends())
    return tuple(parse_list(value, "backends", known))


def _check_out_path(path: Path | None, argument: str = "out", make_parent: bool = False) -> None:
    """Fail before the run, not after it, when an output file cannot be written.
    ``make_parent``: its directories are made (now rather than after the run) as the
    writer would make them."""
    if path is None:
        return
    parent = path.resolve().parent
    if path.is_dir():
        raise InvalidArgumentError(argument, str(path), "a file path, not a directory")
    if make_parent:
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidArgumentError(argument, str(path), f"a path whose directory can be made ({exc})") from None
    if not parent.is_dir():
        raise InvalidArgumentError(argument, str(path), f"a path in an existing directory; {parent} is not one")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise InvalidArgumentError(argument, str(path), "a writable path")


def _check_distinct_outputs(args: argparse.Namespace) -> None:
    """The outputs are written one after another, so two naming one file kept only the
    last: the JSON record was overwritten by the Markdown table, both reported as written."""
    seen: dict[Path, str] = {}
    for argument in ("out", "markdown", "plot"):
        path = getattr(args, argument)
        if path is None:
            continue
        first = seen.setdefault(path.resolve(), argument)
        if first != argument:
            raise InvalidArgumentError(
                argument, str(path), f"a file other than --{first}'s; each output is a file of its own"
            )


def options(args: argparse.Namespace) -> BenchOptions:
    """Validated options; every bad value raises naming the argument and what is allowed."""
    _check_out_path(args.out)
    _check_out_path(args.markdown, "markdown", make_parent=True)
    _check_out_path(args.plot, "plot", make_parent=True)
    _check_distinct_outputs(args)
    device = torch_device(args.device)
    cpu = device.type == "cpu"
    scale = default_scale(args.scale, cpu)
    recipes = tuple(parse_list(args.recipe, "recipe", tuple(gg.RECIPES)))
    cases = args.cases
    if cases is None:
        cases = _CPU_MX_CASES if cpu and any(gg.get_recipe(r).is_mx for r in recipes) else "all"
    return BenchOptions(
        cases=tuple(select_cases(cases, scale, args.rows_per_group)),
        ops=tuple(parse_list(args.ops, "ops", OPS)),
        splits=tuple(parse_list(args.splits, "splits", SPLIT_KINDS)),
        recipes=recipes,
        backends=_backends(args.backends),
        device=device,
        plan=_plan(args, device),
        verify=not args.no_verify,
        peer=not args.no_peer,
        mx_weights="prequantized" if args.prequantized_weights else args.mx_weights,
        device_splits=args.device_splits,
        seed=args.seed,
    )


def run_command(args: argparse.Namespace) -> int:
    """``grouped-gemm bench``."""
    opts = options(args)
    plot_missing = plot.missing() if args.plot else None
    if plot_missing:
        print(f"grouped-gemm bench: --plot: {plot_missing}", file=sys.stderr)
    started = time.perf_counter()
    env = environment.describe(opts.device)
    if args.commit:
        env["git"] = {"commit": args.commit, "dirty": None, "source": "--commit"}
    kinds = {ceilings.matmul_kind(r) for r in opts.recipes} | {"bf16"}
    if opts.device.type == "cuda":
        kinds.add("fp8")  # the chip's fp8 rate is always worth recording; on the CPU it costs seconds
    measured = ceilings.measure(kinds, opts.device)
    print(report.header(env, measured, opts))
    print(
        f"running: {len(opts.cases)} case(s) x {len(opts.splits)} split(s) x {len(opts.recipes)} recipe(s) x "
        f"{len(opts.ops)} op(s) = {opts.problems} problems"
        + (" (MX fwd/dgrad twice: --mx-weights both)" if opts.mx_weights == "both" else "")
        + "; backends: "
        + (opts.backends if isinstance(opts.backends, str) else ", ".join(opts.backends))
        + ("; peer torch._grouped_mm bf16" if opts.peer else "")
    )
    sys.stdout.flush()
    progress = Progress(opts.problems, enabled=not args.quiet)
    result = Sweep(opts, measured, progress).run()
    elapsed = time.perf_counter() - started
    print()
    print(report.table(result.rows))
    issues = report.problems_with_issues(result.rows)
    for line in report.reliability_note(result.rows) + issues + report.ineligible_summary(result.ineligible):
        print(line)
    doc = report.document(opts, env, measured, result, elapsed)
    if args.out:
        report.write_json(args.out, doc)
        print(f"wrote {args.out}")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(report.markdown(result.rows, env, measured), encoding="utf-8")
        print(f"wrote {args.markdown}")
    if args.plot and not plot_missing:
        plot.write_png(result.rows, args.plot, f"{env['device']['name']} {env['date']}")
        print(f"wrote {args.plot}")
    elif plot_missing:
        print(f"no plot: {plot_missing}", file=sys.stderr)
    print(f"bench finished in {elapsed:.1f} s")
    failed = any(r.status in ("wrong", "error") for r in result.rows)
    return 1 if failed else 0
