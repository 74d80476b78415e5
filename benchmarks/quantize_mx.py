"""GPU benchmark of the fused MX quantizer: an 8192 x 7168 bf16 tensor to E4M3 and E2M1,
blocks along the last axis and along axis 0.

Reports the median time over ``triton.testing.do_bench`` runs and the bandwidth as bytes
read plus bytes written (data and scales) per second, next to a device-to-device copy of
the same input measured in the same run (the practical ceiling). ``--sweep`` also times
every launch shape of a small grid per case and reports the fastest (to choose defaults).

    python benchmarks/quantize_mx.py [--sweep] [--cases e2m1:-1,e4m3:0] [--out results.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import triton

import grouped_gemm as gg
from grouped_gemm.mx import FORMATS, triton_quantizer

SHAPE = (8192, 7168)
CASES = [("e4m3", -1), ("e2m1", -1), ("e4m3", 0), ("e2m1", 0)]
# Tiles per case: (blocks, rows, warps) along the last axis, (inner, blocks, warps) along
# axis 0 (see triton_quantizer.quantize). E2M1 along the last axis gives each thread whole
# blocks, so its grid keeps 32 or 64 elements per thread; the strided kernel puts warps on
# blocks (blocks >= warps) and spills past 128 elements per thread.
FP8_LAST_TILES = [(b, r, w) for b, r, w in itertools.product((4, 8, 16), (4, 8, 16, 32), (4, 8)) if b * r <= 256]
E2M1_LAST_TILES = [
    (b, r, w) for b, r, w in itertools.product((8, 16, 32), (4, 8, 16, 32), (2, 4, 8)) if b * r // w in (32, 64)
]
STRIDED_TILES = [
    (i, b, w)
    for i, b, w in itertools.product((32, 64, 128), (1, 2, 4, 8), (1, 2, 4, 8))
    if w <= b and 32 <= i * b // w <= 128
]
TILES = {
    ("e4m3", -1): FP8_LAST_TILES,
    ("e2m1", -1): E2M1_LAST_TILES,
    ("e4m3", 0): STRIDED_TILES,
    ("e2m1", 0): STRIDED_TILES,
}


def parse_cases(text: str) -> list[tuple[str, int]]:
    cases = []
    for item in text.split(","):
        fmt, _, axis = item.strip().partition(":")
        case = (fmt, int(axis)) if axis.lstrip("-").isdigit() else None
        if case not in CASES:
            raise argparse.ArgumentTypeError(f"{item!r}: not one of {', '.join(f'{f}:{a}' for f, a in CASES)}")
        cases.append(case)
    return cases


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def moved_bytes(x: torch.Tensor, q: gg.MXTensor) -> int:
    return x.numel() * x.element_size() + q.data.numel() * q.data.element_size() + q.scale.numel()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time a grid of launch shapes per case")
    parser.add_argument(
        "--cases",
        type=parse_cases,
        default=CASES,
        help="comma-separated fmt:axis cases to run (default: e4m3:-1,e2m1:-1,e4m3:0,e2m1:0)",
    )
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA / ROCm GPU", file=sys.stderr)
        return 2
    x = torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16)
    copy_ms = median_ms(lambda: torch.empty_like(x).copy_(x))
    copy_tbs = 2 * x.numel() * x.element_size() / copy_ms / 1e9
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": list(SHAPE),
        "copy": {"ms": copy_ms, "tb_per_s": copy_tbs},
        "cases": [],
    }
    print(f"{results['device']}  torch {torch.__version__}  triton {triton.__version__}  input {SHAPE} bf16")
    print(f"device copy: {copy_ms * 1e3:8.1f} us  {copy_tbs:5.2f} TB/s")
    for fmt, axis in args.cases:
        q = gg.quantize_mx(x, fmt, axis=axis)
        ms = median_ms(lambda fmt=fmt, axis=axis: gg.quantize_mx(x, fmt, axis=axis))
        nbytes = moved_bytes(x, q)
        case = {"fmt": fmt, "axis": axis, "ms": ms, "bytes": nbytes, "tb_per_s": nbytes / ms / 1e9}
        share = case["tb_per_s"] / copy_tbs
        line = f"{fmt} axis {axis:2d}: {ms * 1e3:8.1f} us  {case['tb_per_s']:5.2f} TB/s  ({share:.0%} of copy)"
        if args.sweep:
            tiles = TILES[fmt, axis]
            timed = []
            for tile in tiles:

                def run(tile=tile, f=FORMATS[fmt], axis=axis % 2):
                    return triton_quantizer.quantize(x, f, axis, "rceil", 32, 0, tile=tile)

                run()
                timed.append((median_ms(run), tile))
            best_ms, best_tile = min(timed)
            case["sweep"] = [{"tile": list(t), "ms": m} for m, t in timed]
            case["best"] = {"tile": list(best_tile), "ms": best_ms, "tb_per_s": nbytes / best_ms / 1e9}
            line += f"   best tile {best_tile}: {best_ms * 1e3:.1f} us {nbytes / best_ms / 1e9:.2f} TB/s"
        results["cases"].append(case)
        print(line)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
