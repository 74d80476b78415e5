"""Host time of a wgrad call with the GPU idle and back to back, and its kernel count.

Why: ``grouped-gemm bench`` times each call's host share with ``perf_counter`` while calls
queue up, so a host share near the call's GPU time can be the host's own work or the
launch queue pushing back. Here each call is also timed right after a sync (the queue
empty: the host's own cost), and one call runs under the profiler to count its kernels.
bf16 (``torch_grouped_mm``) and mxfp8 (its sm_90 route), on qwen3-30B gate-up (G=128,
M=32768, N=1536, K=2048) and a tiny problem (G=8, M=64, N=K=256), device splits.

    python benchmarks/wgrad_host_probe.py [--calls 30] [--table]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

import grouped_gemm as gg

CASES = {"qwen3_30b_gateup": (128, 32768, 1536, 2048), "tiny": (8, 64, 256, 256)}


def _operands(groups: int, m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    splits = torch.tensor(gg.balanced_splits(groups, m), device="cuda", dtype=torch.int32)
    return dy, x, splits


def _host_us(fn, calls: int, idle: bool) -> list[float]:
    spent = []
    for _ in range(calls):
        if idle:
            torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        spent.append((time.perf_counter() - began) * 1e6)
    torch.cuda.synchronize()
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--table", action="store_true", help="print the profiler's table for the mxfp8 call")
    args = parser.parse_args()
    for name, shape in CASES.items():
        dy, x, splits = _operands(*shape)
        for recipe in ("bf16", "mxfp8"):
            fn = functools.partial(gg.grouped_gemm_wgrad, dy, x, splits, recipe=recipe)
            for _ in range(5):
                fn()
            idle = _host_us(fn, args.calls, idle=True)
            began = time.perf_counter()
            queued = _host_us(fn, args.calls, idle=False)
            wall = (time.perf_counter() - began) / args.calls * 1e6
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                fn()
                torch.cuda.synchronize()
            kernels = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())
            print(
                f"{name} {recipe}: host idle median {statistics.median(idle):.0f} us (min {min(idle):.0f}); "
                f"back-to-back median {statistics.median(queued):.0f} us; wall/call {wall:.0f} us; "
                f"kernels/call {kernels}",
                flush=True,
            )
            if args.table and recipe == "mxfp8":
                print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
