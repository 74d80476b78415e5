"""GPU benchmark: a (G, N, K) bf16 weight quantized for fwd and dgrad from one read against
the two passes a training step makes otherwise, with a device copy of the weight as the
bandwidth yardstick: plain MXTensors (``gg.quantize_mx_weight_pair`` against
``quantize_mx_weight`` along K, then along N: what ``hip_mxfp8`` takes) and, with
``--upcast``, the Triton backends' sm_90 upcast layouts (``layouts.quantize_upcast_pair``
against ``quantize_upcast_weight`` per op), E4M3 and E2M1. Rounds interleave the
contenders; each figure is the median round of ``--calls`` back-to-back calls. ``--sweep``
adds the pair kernels' other tiles. Outputs are checked bit for bit first.

    python benchmarks/weight_pair.py [--cases gptoss120b_gateup,...] [--fmt e4m3] [--upcast] [--sweep] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

import torch

import grouped_gemm as gg
from grouped_gemm.backends.triton_mx import layouts
from grouped_gemm.bench.shapes import select_cases
from grouped_gemm.bench.timing import back_to_back_ms
from grouped_gemm.mx import FORMATS, triton_quantizer

TILES = [(1, 4, 4), (1, 2, 4), (2, 2, 4), (1, 8, 4), (1, 8, 8), (2, 4, 8), (4, 2, 8)]


def _same(a: gg.MXTensor, b: gg.MXTensor) -> bool:
    return torch.equal(a.scale, b.scale) and torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))


def _time_case(groups: int, n: int, k: int, args: argparse.Namespace) -> dict[str, float]:
    """Median ms per contender on one fresh (groups, n, k) bf16 weight."""
    w = torch.randn(groups, n, k, device="cuda", dtype=torch.bfloat16)
    pad = k % 32 != 0 or n % 32 != 0
    pads = (-k % 32 if pad else 0, -n % 32 if pad else 0)

    def fwd() -> gg.MXTensor:
        return gg.quantize_mx_weight(w, args.fmt, op="fwd", pad=pad)

    def dgrad() -> gg.MXTensor:
        return gg.quantize_mx_weight(w, args.fmt, op="dgrad", pad=pad)

    pair = gg.quantize_mx_weight_pair(w, args.fmt, pad=pad)
    assert _same(pair[0], fwd()) and _same(pair[1], dgrad()), (groups, n, k)
    fns = {
        "copy": w.clone,
        "fwd": fwd,
        "dgrad": dgrad,
        "both": lambda: (fwd(), dgrad()),
        "pair": lambda: gg.quantize_mx_weight_pair(w, args.fmt, pad=pad),
    }
    fmt = FORMATS[args.fmt]
    for tile in TILES[1:] if args.sweep else []:
        fns[f"pair{tile}"] = lambda tile=tile: triton_quantizer.quantize_pair(w, fmt, "rceil", 32, pads, tile=tile)
    return _interleaved(fns, args)


#: (fwd rows, dgrad rows, warps) of the upcast pair kernel swept with --sweep.
UPCAST_TILES = [(16, 32, 4), (32, 32, 4), (16, 32, 8), (32, 64, 4), (16, 16, 2)]


def _time_upcast(groups: int, n: int, k: int, fmt: str, args: argparse.Namespace) -> dict[str, float]:
    """Median ms: the fwd and dgrad upcast layouts per op, both, and from the pair kernel."""
    w = torch.randn(groups, n, k, device="cuda", dtype=torch.bfloat16)

    def one(op: str) -> layouts.UpcastWeight:
        return layouts.quantize_upcast_weight(w, op, "rceil", fmt=fmt)

    pair = layouts.quantize_upcast_pair(w, "rceil", fmt=fmt)
    for got, op in zip(pair, ("fwd", "dgrad"), strict=True):
        want = one(op)
        assert torch.equal(got.data, want.data) and torch.equal(got.scales, want.scales), (fmt, op)
    fns = {
        "copy": w.clone,
        "fwd": lambda: one("fwd"),
        "dgrad": lambda: one("dgrad"),
        "both": lambda: (one("fwd"), one("dgrad")),
        "pair": lambda: layouts.quantize_upcast_pair(w, "rceil", fmt=fmt),
    }
    for tile in UPCAST_TILES if args.sweep else []:
        fns[f"pair{tile}"] = lambda tile=tile: layouts.quantize_upcast_pair(
            w, "rceil", fmt=fmt, rows=tile[:2], warps=tile[2]
        )
    return _interleaved(fns, args)


def _interleaved(fns: dict, args: argparse.Namespace) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(args.rounds):
        names = list(fns)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fns[name]()
            samples[name].append(back_to_back_ms(fns[name], args.calls))
    return {name: round(statistics.median(v), 4) for name, v in samples.items()}


def _print_row(name: str, ms: dict[str, float], sweep: bool) -> None:
    print(
        f"{name:26s} {ms['copy']:7.3f} {ms['fwd']:7.3f} {ms['dgrad']:7.3f} {ms['both']:7.3f} "
        f"{ms['pair']:7.3f} {ms['pair'] / ms['both']:9.3f}"
    )
    if sweep:
        tiles = {k: v for k, v in ms.items() if k.startswith("pair")}
        print("    tiles: " + " ".join(f"{k[4:] or '(default)'}:{v:.3f}" for k, v in tiles.items()))
        print(f"    fastest: {min(tiles, key=tiles.get)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="gptoss120b_gateup,dsv3_gateup_ep8,qwen3_30b_gateup,mixtral_down")
    p.add_argument("--fmt", default="e4m3", choices=("e4m3", "e5m2"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--upcast", action="store_true", help="also the Triton sm_90 upcast layouts, E4M3 and E2M1")
    p.add_argument("--out", type=pathlib.Path)
    args = p.parse_args()
    rows = []
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {args.fmt}, bf16 weights")
    print(f"{'case':26s} {'copy':>7s} {'fwd':>7s} {'dgrad':>7s} {'both':>7s} {'pair':>7s} {'pair/both':>9s}  (ms)")
    for case in select_cases(args.cases):
        ms = _time_case(case.groups, case.n, case.k, args)
        rows.append({"case": case.name, "kind": "mx", "shape": [case.groups, case.n, case.k], "ms": ms})
        _print_row(case.name, ms, args.sweep)
        torch.cuda.empty_cache()
        for fmt in ("e4m3", "e2m1") if args.upcast else ():
            ms = _time_upcast(case.groups, case.n, case.k, fmt, args)
            rows.append({"case": case.name, "kind": f"upcast {fmt}", "shape": [case.groups, case.n, case.k], "ms": ms})
            _print_row(f"{case.name} upcast {fmt}", ms, args.sweep)
            torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "weight_pair.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
