"""How close the sm_90 MX wgrad's operand pass runs to the copy bandwidth, per tile.

Why: on the sm_90 route an mxfp8 / mxfp4 wgrad is two quantize-and-decode passes over dy
and x (``launch.quantize_decode_rows``: 2 bytes read and 2 written per element) and then
the bf16 GEMM the peer runs. With the passes at the copy ceiling the route's ratio to the
peer is at most T_gemm / (T_gemm + T_passes): 0.75 on qwen3-30B down and 0.82 on its
gate-up, 0.86-0.93 on the other compute-bound cases (H200 readings, issue 11), while the
measured ratios sit 0.03-0.11 below those bounds. Each program quantizes one 32-row block
by ``bc`` columns after a binary search for its group (``group_rows``): a narrow tile pays
the search's dependent loads for little data.

For each case this times the pass on dy and on x with the default tile and wider ones
(``triton.testing.do_bench``), interleaved with a device copy of the same tensor (read +
write), after checking every tile writes the default's bits. GB/s counts 4 bytes an element.

    python benchmarks/wgrad_prep_sweep.py [--cases NAMES] [--splits skewed]
"""

from __future__ import annotations

import argparse
import sys

import torch
from triton.testing import do_bench

import grouped_gemm as gg
from grouped_gemm.backends.triton_mx import launch
from grouped_gemm.backends.triton_mx.dequant_kernel import DequantTile
from grouped_gemm.bench.shapes import select_cases

TILES = [
    DequantTile(br=32, bc=bc, warps=w) for bc in (128, 256, 512, 1024) for w in (4, 8) if bc * 32 // (w * 32) <= 256
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="qwen3_30b_down,qwen3_30b_gateup,dsv3_down_ep8")
    parser.add_argument("--splits", default="balanced", choices=("balanced", "skewed"))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}")
    for case in select_cases(args.cases):
        splits = case.splits(args.splits)
        m = sum(splits)
        sizes = torch.tensor(splits, device="cuda", dtype=torch.int32)
        starts, padded_starts, padded_rows = gg.mx.padded_row_offsets(sizes, m, torch.device("cuda"))
        for name, cols in (("dy", case.n), ("x", case.k)):
            src = torch.randn(m, cols, device="cuda", dtype=torch.bfloat16)
            dst = torch.empty_like(src)

            def run(tile, src=src, table=(starts, padded_starts, padded_rows)):
                return launch.quantize_decode_rows(src, *table, "e4m3", "rceil", tile)

            want = run(None)
            tiles = [t for t in TILES if torch.equal(run(t), want) or print(f"{t}: differs from the default")]
            calls = {"copy": lambda src=src, dst=dst: dst.copy_(src), "default": lambda: run(None)}
            calls.update({f"bc={t.bc} warps={t.warps}": (lambda t=t: run(t)) for t in tiles})
            times: dict[str, list[float]] = {k: [] for k in calls}
            for r in range(args.rounds):
                names = list(calls)
                for key in names[r % len(names) :] + names[: r % len(names)]:
                    times[key].append(do_bench(calls[key], warmup=5, rep=30))
            nbytes = 4 * m * cols
            for key, t in times.items():
                ms = min(t)
                rate = nbytes / ms / 1e6
                print(f"{case.name:18s} {name:2s} ({m}x{cols}) {key:20s} {ms * 1e3:8.1f} us {rate:7.0f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
