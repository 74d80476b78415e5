"""``grouped-gemm`` (also ``python -m grouped_gemm``): inspect backends and decisions, check, benchmark, tune."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence

import grouped_gemm as gg
from grouped_gemm import check
from grouped_gemm.bench import command as bench
from grouped_gemm.bench import tune
from grouped_gemm.device import known_archs
from grouped_gemm.problem import OPS
from grouped_gemm.registry import registry
from grouped_gemm.tools import torch_device


def _support(spec: gg.BackendSpec) -> str:
    archs = f" archs {','.join(spec.archs)}" if spec.archs else ""
    extras = [flag for flag, on in (("host splits", spec.host_splits), ("weight lists", spec.weight_list)) if on]
    return (
        f"ops {','.join(sorted(spec.ops))}; recipes {','.join(sorted(spec.recipes))}; "
        f"vendors {','.join(sorted(spec.vendors))}{archs}" + (f"; {', '.join(extras)}" if extras else "")
    )


#: Columns the human-readable output wraps to.
WIDTH = 100


def _wrapped(label: str, text: str) -> list[str]:
    return textwrap.wrap(
        text,
        WIDTH,
        initial_indent=f"  {label}",
        subsequent_indent="    ",
        break_long_words=False,
        break_on_hyphens=False,
    )


def cmd_backends(args: argparse.Namespace) -> int:
    """List every backend, what it supports, and whether it can run here."""
    infos = gg.list_backends(args.arch)
    device = gg.describe_problem(groups=1, m=1, n=1, k=1, device=args.arch).device
    print(f"device: {device}")
    print("priority: the backend's rank on this device when no order is set (higher first)")
    for info in infos:
        state = "available" if info.available else "unavailable: " + "; ".join(str(r) for r in info.reasons_here)
        print(f"\n{info.name} {info.version}  (priority {info.priority_here})")
        lines = _wrapped("", info.spec.description) if info.spec.description else []
        lines += _wrapped("plugin: ", info.plugin)
        lines += _wrapped("supports: ", _support(info.spec)) + _wrapped("here: ", state)
        status = _status(info.name)
        if status:
            lines += _wrapped("status: ", status)
        print("\n".join(lines))
    failures = gg.plugin_failures()
    if failures:
        print("\nplugins that failed to load:")
        for failure in failures:
            print("\n".join(_wrapped("", str(failure))))
    return 0


def _status(name: str) -> str | None:
    """A backend's own state line (e.g. a compiled backend's build), if it has a ``status()``;
    one that raises is reported in its line, not let end the listing of every backend."""
    status = getattr(registry().get(name).backend, "status", None)
    return _hook_answer(status) if callable(status) else None


def _hook_answer(hook: Callable[[], object]) -> str | None:
    """``hook()`` as text (None stays None), or what it raised: a plugin's optional CLI hooks
    are its own code, and a broken one must not end the command for the other backends."""
    try:
        answer = hook()
    except Exception as exc:  # noqa: BLE001 - reported against that backend
        return f"{getattr(hook, '__name__', 'hook')}() raised {type(exc).__name__}: {exc}"
    return None if answer is None else str(answer)


def cmd_build(args: argparse.Namespace) -> int:
    """Build every backend that compiles on first use (or the one named) for this machine now."""
    # `is not None`: an empty name (`build ""`, an unset shell variable) is an unknown backend, not every one.
    entries = [registry().get(args.backend)] if args.backend is not None else registry().entries()
    builders = [(e.spec.name, e.backend.build) for e in entries if callable(getattr(e.backend, "build", None))]
    if not builders:
        print(f"{args.backend or 'no backend'}: nothing to build")
        return 0
    failed = 0
    for name, build in builders:
        reason = _hook_answer(build)
        failed += reason is not None
        print(f"{name}: not built: {reason}" if reason is not None else f"{name}: {_status(name) or 'built'}")
    return 1 if failed else 0


def cmd_explain(args: argparse.Namespace) -> int:
    """Print the decision table for a described problem."""
    decision = gg.explain(
        op=args.op,
        recipe=args.recipe,
        backend=args.backend,
        groups=args.groups,
        m=args.m,
        n=args.n,
        k=args.k,
        device=args.arch,
        splits="skewed" if args.skew else "balanced",
        device_splits=args.device_splits,
        accumulate=args.accumulate,
        out_dtype=args.out_dtype,
    )
    print(decision.table(WIDTH))
    return 0 if decision.selected else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grouped-gemm",
        description="Inspect grouped_gemm's backends and routing decisions, check them, benchmark them. "
        "Also runs as 'python -m grouped_gemm'.",
    )
    parser.set_defaults(func=lambda _: _print_help(parser))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("backends", help="list backends and whether they can run here")
    p.add_argument("--arch", choices=known_archs(), help="describe this arch instead of this machine")
    p.set_defaults(func=cmd_backends)

    p = sub.add_parser("build", help="compile the backends that build on first use, now")
    p.add_argument("backend", nargs="?", help="only this backend (default: every one that builds)")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("explain", help="show which backend a described problem goes to, and why")
    p.add_argument("--op", choices=OPS, default="fwd")
    p.add_argument("--recipe", choices=list(gg.RECIPES), default="bf16")
    p.add_argument("--groups", "-G", type=int, required=True)
    p.add_argument("--m", "-M", type=int, required=True, help="total rows over all groups")
    p.add_argument("--n", "-N", type=int, required=True)
    p.add_argument("--k", "-K", type=int, required=True)
    p.add_argument("--skew", action="store_true", help="skewed splits (moe_shapes.json rule) instead of balanced")
    p.add_argument("--arch", choices=known_archs(), help="describe this arch instead of this machine")
    p.add_argument("--backend", help="per-call order, e.g. 'torch_grouped_mm,reference'")
    p.add_argument("--device-splits", action="store_true", help="m_splits live on the device")
    p.add_argument("--accumulate", action="store_true", help="wgrad accumulating into an existing buffer")
    p.add_argument(
        "--out-dtype",
        choices=("bfloat16", "float16", "float32"),
        help="output dtype (default: the inputs'); float32 with --accumulate is Megatron's main_grad",
    )
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("bench", help="time every eligible backend against torch._grouped_mm on the MoE shapes")
    bench.add_arguments(p)
    p.set_defaults(func=bench.run_command)

    p = sub.add_parser("tune", help="pre-tune the MoE shapes for autotuning (--show: the stored choices)")
    tune.add_arguments(p)
    p.set_defaults(func=tune.run_command)

    p = sub.add_parser("check", help="check every backend that runs here against the reference (pass/fail)")
    check.add_arguments(p)
    p.set_defaults(func=check.run_command)
    return parser


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 0


#: Commands that run every backend, the Triton ones on the CPU in Triton's interpreter.
_INTERPRETED = ("bench", "check")


def _rerun_interpreted(args: argparse.Namespace, argv: Sequence[str]) -> int | None:
    """``check`` / ``bench`` on the CPU rerun in a child Python with ``TRITON_INTERPRET=1``
    (None: run here). Triton reads the switch when a function is decorated, and importing
    grouped_gemm has imported ``triton.language`` already: set now, its own jit functions
    (``tl.cdiv``) stayed compiled-only, and every Triton backend failed every run with
    "Cannot call @triton.jit'd outside of the scope of a kernel"."""
    if args.command not in _INTERPRETED or "TRITON_INTERPRET" in os.environ:
        return None
    if torch_device(args.device).type != "cpu":
        return None
    sys.stdout.flush()
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.call([sys.executable, "-m", "grouped_gemm", *argv], env=env)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        rerun = _rerun_interpreted(args, argv)
        return rerun if rerun is not None else args.func(args)
    except gg.GroupedGemmError as exc:
        print(f"grouped-gemm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
