"""GPU benchmark of the fused MX quantizer: an 8192 x 7168 bf16 tensor to E4M3 and E2M1,
blocks along the last axis and along axis 0.

Reports the median time over ``triton.testing.do_bench`` runs and the bandwidth as bytes
read plus bytes written (data and scales) per second, next to a device-to-device copy of
the same input measured in the same run (the practical ceiling). ``--sweep`` also times
every launch shape of a small grid per case and reports the fastest (to choose defaults).

    python benchmarks/quantize_mx.py [--sweep] [--out results.json]
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
LAST_AXIS_TILES = [(b, r, w) for b, r, w in itertools.product((4, 8, 16), (4, 8, 16, 32), (4, 8)) if b * r <= 256]
STRIDED_TILES = list(itertools.product((64, 128, 256), (1, 2, 4), (4, 8)))


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def moved_bytes(x: torch.Tensor, q: gg.MXTensor) -> int:
    return x.numel() * x.element_size() + q.data.numel() * q.data.element_size() + q.scale.numel()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time a grid of launch shapes per case")
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
    for fmt, axis in CASES:
        q = gg.quantize_mx(x, fmt, axis=axis)
        ms = median_ms(lambda fmt=fmt, axis=axis: gg.quantize_mx(x, fmt, axis=axis))
        nbytes = moved_bytes(x, q)
        case = {"fmt": fmt, "axis": axis, "ms": ms, "bytes": nbytes, "tb_per_s": nbytes / ms / 1e9}
        share = case["tb_per_s"] / copy_tbs
        line = f"{fmt} axis {axis:2d}: {ms * 1e3:8.1f} us  {case['tb_per_s']:5.2f} TB/s  ({share:.0%} of copy)"
        if args.sweep:
            tiles = LAST_AXIS_TILES if axis == -1 else STRIDED_TILES
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
