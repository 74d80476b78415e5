"""Where the upcast kernel should quantize its activations itself: H200 / H100 experiments.

The sm_90 MX routes (mxfp8, mxfp4, a8w4) quantize-and-decode the bf16 activations in a pass
of their own (``launch.quantize_decode``) before the upcast GEMM: a second launch, about
20 us of host time per call on the GPU host (docs/performance.md, issue 14). With
``launch_upcast(..., quantize=(fmt, rule))`` the GEMM does it on its loaded activation
slabs instead, once per weight column tile: no second launch, no decoded copy written and
read back, but the quantization repeated for every column tile of the weight.

For each case, split and op (fwd: x @ W^T with W quantized along K; dgrad: dy @ W with W
quantized along N) this times, kernel alone (``triton.testing.do_bench``, L2 flushed
between calls), the two-launch route, the fused launch and ``torch._grouped_mm`` bf16 on
the same problem, interleaved over rounds, with the default tile, after checking the two
routes write the same bits. The library fuses only on small weights
(``launch.FUSED_MAX_WEIGHT``, ``FUSED_MAX_BM``, set from this probe's readings); here both
limits are lifted so that the fused launch runs on every case and tile (``--no-fused``
leaves it out). A fused kernel that does not build is reported and left out. ``--parts``
also times the two launches apart (the pass alone, the GEMM alone on decoded activations):
``peer / (peer + pass)`` is the most the two-launch route can reach with a GEMM as fast as
the peer.

    python benchmarks/fused_activation_probe.py [--cases NAMES] [--rows-per-group R,...]
        [--ops fwd,dgrad] [--recipes mxfp8,mxfp4] [--no-fused] [--parts] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch
import triton
from triton.testing import do_bench

import grouped_gemm as gg
from grouped_gemm.backends.triton_mx import launch, layouts, layouts_e4m3
from grouped_gemm.bench.shapes import select_cases
from grouped_gemm.mx import quantize_mx_weight

#: (activation format, weight format) of each recipe timed.
RECIPES = {"mxfp8": ("e4m3", "e4m3"), "mxfp4": ("e2m1", "e2m1")}
DECODE = "dsv3_gateup_decode,qwen3_30b_gateup_decode,gptoss120b_gateup_decode"


def _layout(fmt: str, w: torch.Tensor, op: str) -> layouts.UpcastWeight:
    """The (G, N, K) weight quantized for ``op``, in the upcast layout."""
    wq = quantize_mx_weight(w, fmt, op=op)
    return layouts_e4m3.upcast_weight_e4m3(wq) if fmt == "e4m3" else layouts.upcast_weight(wq)


def _problem(case, kind: str, op: str, rounds: int, recipes: list[str], fused: bool, parts: bool) -> list[dict]:
    splits = case.splits(kind)
    g, m, n, k = case.groups, sum(splits), case.n, case.k
    w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    sizes = torch.tensor(splits, device="cuda", dtype=torch.int32)
    offs = torch.cumsum(sizes, 0, dtype=torch.int32)
    if op == "fwd":  # x (M, K) @ W_g^T: the weight's rows are N, contracted over K
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        peer_w, n_out = w.transpose(1, 2), n
    else:  # dgrad: dy (M, N) @ W_g: the weight's rows are K, contracted over N
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        peer_w, n_out = w, k
    out = torch.empty(m, n_out, device="cuda", dtype=torch.bfloat16)
    calls = {"torch._grouped_mm": lambda: torch._grouped_mm(x, peer_w, offs=offs)}
    for recipe in recipes:
        a_fmt, w_fmt = RECIPES[recipe]
        lay = _layout(w_fmt, w, op)
        decoded = launch.quantize_decode(x, a_fmt, "rceil")
        two = launch.launch_upcast(decoded, lay, sizes, out, g).clone()
        calls[f"{recipe} two launches"] = lambda lay=lay, a_fmt=a_fmt: launch.launch_upcast(
            launch.quantize_decode(x, a_fmt, "rceil"), lay, sizes, out, g
        )
        if fused:
            try:
                one = launch.launch_upcast(x, lay, sizes, out.fill_(float("nan")), g, quantize=(a_fmt, "rceil"))
            except (RuntimeError, triton.runtime.errors.OutOfResources) as exc:  # the largest tiles
                print(f"{case.name} {kind} {op} {recipe}: fused launch failed: {type(exc).__name__}: {exc}")
                one = None
        if fused and one is not None:
            if not torch.equal(one, two):
                print(f"{case.name} {kind} {op} {recipe}: fused != two launches (max |diff| {(one - two).abs().max()})")
            calls[f"{recipe} fused"] = lambda lay=lay, a_fmt=a_fmt: launch.launch_upcast(
                x, lay, sizes, out, g, quantize=(a_fmt, "rceil")
            )
        if parts:
            calls[f"{recipe} pass alone"] = lambda a_fmt=a_fmt: launch.quantize_decode(x, a_fmt, "rceil")
            calls[f"{recipe} GEMM alone"] = lambda lay=lay, decoded=decoded: launch.launch_upcast(
                decoded, lay, sizes, out, g
            )
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds):
        names = list(calls)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(do_bench(calls[name], warmup=10, rep=40) * 1e3)
    peer = min(times["torch._grouped_mm"])
    rows = []
    for name, t in times.items():
        best = min(t)
        rows.append({"case": case.name, "splits": kind, "op": op, "call": name, "us": round(best, 2)})
        print(f"{case.name:26s} {kind:9s} {op:5s} {name:22s} {best:9.1f} us {peer / best:6.2f}x peer", flush=True)
    for recipe in recipes if parts else []:
        bound = peer / (peer + min(times[f"{recipe} pass alone"]))
        print(f"{case.name:26s} {kind:9s} {op:5s} {recipe} bound peer/(peer+pass) {bound:6.3f}", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=DECODE, help="cases of moe_shapes.json (default: the decode ones)")
    parser.add_argument("--rows-per-group", default=None, help="each case at these token counts per group")
    parser.add_argument("--splits", default="balanced,skewed")
    parser.add_argument("--ops", default="fwd", help="fwd, dgrad or both")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="of " + ", ".join(RECIPES))
    parser.add_argument("--no-fused", action="store_true", help="leave the fused launch out")
    parser.add_argument("--parts", action="store_true", help="also time the pass and the GEMM apart")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=None, help="JSON file for the rows")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} grouped_gemm {gg.__version__}")
    recipes = args.recipes.split(",")
    launch.FUSED_MAX_WEIGHT = 1 << 62  # fuse on every case and tile (before any launch plan is made)
    launch.FUSED_MAX_BM = 1 << 30
    rows = []
    for case in select_cases(args.cases, rows_per_group=args.rows_per_group):
        for kind in args.splits.split(","):
            for op in args.ops.split(","):
                rows += _problem(case, kind, op, args.rounds, recipes, not args.no_fused, args.parts)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
