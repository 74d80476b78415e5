"""What limits the upcast kernel on decode-like calls: H200 experiments.

On ``gptoss120b_gateup_decode`` (balanced), with E2M1 (default) or E4M3 weights:

- default: times the upcast kernel (default tiles) with its sm_90 PTX decode, with the PTX
  decode without the folded scale (one more bf16x2 multiply per element pair) and with the
  portable decode (more integer instructions per element), all reading the same bytes. If
  the time follows the decode's instruction count, the SMs' instruction issue is the
  limit; if not, the weight stream is.
- ``--sweep``: times the 16-row tile with more pipeline stages and programs per SM than
  the defaults, interleaved with ``torch._grouped_mm`` on the same problem. If the time
  falls as more weight bytes are in flight, memory latency is the limit.
- ``--ncu``: launches the default kernel once, for ``ncu`` to profile.

Run from the repository root::

    python benchmarks/decode_probe.py [--fmt e4m3] [--sweep | --ncu]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
from triton.testing import do_bench

from grouped_gemm.backends.triton_mx import launch, layouts, layouts_e4m3
from grouped_gemm.mx import quantize_mx_weight

G, M, N, K = 128, 256, 5760, 2880


def _layouts(fmt: str, g: int, n: int, k: int) -> tuple[layouts.UpcastWeight, layouts.UpcastWeight]:
    """(folded, unfolded) upcast layouts of one random weight."""
    wq = quantize_mx_weight(torch.randn(g, n, k, device="cuda"), fmt)
    if fmt == "e4m3":
        return layouts_e4m3.upcast_weight_e4m3(wq), layouts_e4m3.build_upcast_weight_e4m3(wq)
    return layouts.upcast_weight(wq), layouts.build_upcast_weight(wq)


def _variants(x, lay, unfolded, splits, out, weight_bytes) -> dict:
    results = {}
    ptx_decode = launch.ptx_decode
    variants = (("ptx decode", True, lay), ("ptx, scale not folded", True, unfolded), ("portable decode", False, lay))
    for name, ptx, weight in variants:
        launch.ptx_decode = lambda device, ptx=ptx: ptx
        ms = do_bench(lambda weight=weight: launch.launch_upcast(x, weight, splits, out, G), warmup=25, rep=200)
        results[name] = {"us": ms * 1e3, "weight_tb_s": weight_bytes / ms / 1e9}
        print(f"{name:22s} {ms * 1e3:8.1f} us  weight stream {weight_bytes / ms / 1e9:.2f} TB/s", flush=True)
    launch.ptx_decode = ptx_decode
    return results


def _sweep(x, lay, splits, out, weight_bytes, rounds: int = 3) -> dict:
    """Stages x programs per SM of the default 16-row tile, those whose shared memory fits
    the SM (``SMEM_BYTES`` for all its programs together), interleaved with the peer."""
    default = launch.upcast_config(M, G, lay.fmt)
    configs = [
        dataclasses.replace(default, stages=s, per_sm=p)
        for s in (4, 6, 8)
        for p in (2, 3, 4)
        if p * dataclasses.replace(default, stages=s).smem_bytes() <= launch.SMEM_BYTES
    ]
    w_bf16 = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16)
    offs = torch.cumsum(splits, 0, dtype=torch.int32)
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        ms = do_bench(lambda: torch._grouped_mm(x, w_bf16.transpose(1, 2), offs=offs), warmup=10, rep=50)
        times.setdefault("torch._grouped_mm", []).append(ms)
        for c in configs:
            ms = do_bench(lambda c=c: launch.launch_upcast(x, lay, splits, out, G, c), warmup=10, rep=50)
            times.setdefault(str(c), []).append(ms)
    peer = min(times["torch._grouped_mm"])
    results = {}
    for name, t in times.items():
        best = min(t)
        results[name] = {"us": best * 1e3, "weight_tb_s": weight_bytes / best / 1e9, "x_peer": peer / best}
        print(f"{name:90s} {best * 1e3:8.1f} us  {weight_bytes / best / 1e9:5.2f} TB/s  {peer / best:5.2f}x peer")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fmt", choices=("e2m1", "e4m3"), default="e2m1", help="weight format")
    parser.add_argument("--sweep", action="store_true", help="stages x programs per SM, against the peer")
    parser.add_argument("--ncu", action="store_true", help="launch once (for ncu) instead of timing")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 2
    splits = torch.full((G,), M // G, device="cuda", dtype=torch.int32)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    lay, unfolded = _layouts(args.fmt, G, N, K)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    weight_bytes = lay.data.numel() * lay.data.element_size() + lay.scales.numel() * 4
    if args.ncu:
        launch.launch_upcast(x, lay, splits, out, G)
        torch.cuda.synchronize()
        return 0
    if args.sweep:
        results = _sweep(x, lay, splits, out, weight_bytes)
    else:
        results = _variants(x, lay, unfolded, splits, out, weight_bytes)
    print(json.dumps({"fmt": args.fmt, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
