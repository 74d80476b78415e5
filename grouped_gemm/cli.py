"""``grouped-gemm`` (also ``python -m grouped_gemm``): inspect backends and decisions, check, benchmark, tune."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grouped_gemm as gg
from grouped_gemm import check
from grouped_gemm.bench import command as bench
from grouped_gemm.bench import tune
from grouped_gemm.device import known_archs
from grouped_gemm.problem import OPS


def _support(spec: gg.BackendSpec) -> str:
    archs = f" archs {','.join(spec.archs)}" if spec.archs else ""
    extras = [flag for flag, on in (("host splits", spec.host_splits), ("weight lists", spec.weight_list)) if on]
    return (
        f"ops {','.join(sorted(spec.ops))}; recipes {','.join(sorted(spec.recipes))}; "
        f"vendors {','.join(sorted(spec.vendors))}{archs}" + (f"; {', '.join(extras)}" if extras else "")
    )


def cmd_backends(args: argparse.Namespace) -> int:
    """List every backend, what it supports, and whether it can run here."""
    infos = gg.list_backends(args.arch)
    device = gg.describe_problem(groups=1, m=1, n=1, k=1, device=args.arch).device
    print(f"device: {device}")
    for info in infos:
        state = "available" if info.available else "unavailable: " + "; ".join(str(r) for r in info.reasons_here)
        print(f"\n{info.name} {info.version}  (plugin {info.plugin}, priority {info.spec.priority})")
        if info.spec.description:
            print(f"  {info.spec.description}")
        print(f"  supports: {_support(info.spec)}")
        print(f"  here: {state}")
    failures = gg.plugin_failures()
    if failures:
        print("\nplugins that failed to load:")
        for failure in failures:
            print(f"  {failure}")
    return 0


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
    )
    print(decision.table())
    return 0 if decision.selected else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grouped-gemm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("backends", help="list backends and whether they can run here")
    p.add_argument("--arch", choices=known_archs(), help="describe this arch instead of this machine")
    p.set_defaults(func=cmd_backends)

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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except gg.GroupedGemmError as exc:
        print(f"grouped-gemm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
