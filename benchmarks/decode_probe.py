"""What limits the upcast kernel on decode-like calls: one H200 experiment.

On ``gptoss120b_gateup_decode`` (balanced), times the upcast kernel (default tiles) with
its sm_90 PTX decode, with the PTX decode without the folded scale (one more bf16x2
multiply per element pair) and with the portable decode (more integer instructions per
element), all reading the same bytes. If the time follows the decode's instruction count,
the SMs' instruction issue is the limit; if not, the weight stream is. With ``--ncu`` it instead
launches the default kernel once, for ``ncu`` to profile. Run from the repository root::

    python benchmarks/decode_probe.py
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from triton.testing import do_bench

from grouped_gemm.backends.triton_mx import launch, layouts
from grouped_gemm.mx import quantize_mx_weight


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ncu", action="store_true", help="launch once (for ncu) instead of timing")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 2
    g, m, n, k = 128, 256, 5760, 2880
    splits = torch.full((g,), m // g, device="cuda", dtype=torch.int32)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wq = quantize_mx_weight(torch.randn(g, n, k, device="cuda"), "e2m1")
    lay = layouts.upcast_weight(wq)
    unfolded = layouts.build_upcast_weight(wq)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    weight_bytes = lay.data.numel() * 4 + lay.scales.numel() * 4
    if args.ncu:
        launch.launch_upcast(x, lay, splits, out, g)
        torch.cuda.synchronize()
        return 0
    results = {}
    ptx_decode = launch.ptx_decode
    variants = (("ptx decode", True, lay), ("ptx, scale not folded", True, unfolded), ("portable decode", False, lay))
    for name, ptx, weight in variants:
        launch.ptx_decode = lambda device, ptx=ptx: ptx
        ms = do_bench(lambda weight=weight: launch.launch_upcast(x, weight, splits, out, g), warmup=25, rep=200)
        results[name] = {"us": ms * 1e3, "weight_tb_s": weight_bytes / ms / 1e9}
        print(f"{name:22s} {ms * 1e3:8.1f} us  weight stream {weight_bytes / ms / 1e9:.2f} TB/s", flush=True)
    launch.ptx_decode = ptx_decode
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
