"""hip_mxfp8 against ``torch._grouped_mm`` (bf16) on the compute-bound MoE shapes, one run.

For every non-decode case of ``benchmarks/moe_shapes.json``, balanced and skewed splits,
and fwd / dgrad / wgrad, it times with CUDA events (``triton.testing.do_bench``, median):

- the peer: ``torch._grouped_mm`` on bf16 operands, group ends precomputed on the device;
- hip_mxfp8 through the public API with device splits: fwd / dgrad with both operands
  passed pre-quantized (``gg.MXTensor``; dgrad's weight transposes to contraction-major
  inside the call), wgrad from bf16 dy and x (it quantizes both along the tokens itself).

Each result is checked against ``reference`` on the same operands (SQNR, fp32 outputs)
before it is timed. The extension is built (or loaded from the cache) first. Run from the
repository root on a GPU::

    python benchmarks/hip_mxfp8.py --out $OUT

Prints a table last and writes ``hip_mxfp8.json`` (every number) under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
from triton.testing import do_bench

import grouped_gemm as gg
from grouped_gemm.backends.hip_mxfp8 import build
from grouped_gemm.backends.hip_mxfp8.backend import HipMxfp8Backend
from grouped_gemm.mx import quantize_mx, quantize_mx_weight
from grouped_gemm.testing import sqnr_db

SHAPES = Path(__file__).with_name("moe_shapes.json")
OPS = ("fwd", "dgrad", "wgrad")


def bench_ms(fn) -> float:
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def run_case(case: dict, split_name: str, op: str, check: bool) -> dict:
    g, m, n, k = case["G"], case["M"], case["N"], case["K"]
    device = torch.device("cuda")
    host = gg.balanced_splits(g, m) if split_name == "balanced" else gg.skewed_splits(g, m)
    splits = torch.tensor(host, device=device)
    offs = torch.cumsum(splits, 0).to(torch.int32)
    gen = torch.Generator(device=device).manual_seed(0)
    if op == "wgrad":
        a = torch.randn(m, n, device=device, dtype=torch.bfloat16, generator=gen)
        b = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
        out = torch.empty(g, n, k, device=device, dtype=torch.bfloat16)
        peer = lambda: torch._grouped_mm(a.t(), b, offs=offs)  # noqa: E731
        call = lambda: gg.grouped_gemm_wgrad(a, b, splits, recipe="mxfp8", out=out, backend="hip_mxfp8")  # noqa: E731
        args = (a, b)
    else:
        a = torch.randn(m, k if op == "fwd" else n, device=device, dtype=torch.bfloat16, generator=gen)
        w = torch.randn(g, n, k, device=device, dtype=torch.bfloat16, generator=gen)
        aq = quantize_mx(a, "e4m3", axis=1)
        wq = quantize_mx_weight(w, "e4m3", op=op)
        fn = gg.grouped_gemm if op == "fwd" else gg.grouped_gemm_dgrad
        out = torch.empty(m, n if op == "fwd" else k, device=device, dtype=torch.bfloat16)
        wt = w.transpose(-2, -1) if op == "fwd" else w
        peer = lambda: torch._grouped_mm(a, wt, offs=offs)  # noqa: E731
        call = lambda: fn(aq, wq, splits, recipe="mxfp8", out=out, backend="hip_mxfp8")  # noqa: E731
        args = (aq, wq)
    row = {"case": case["name"], "splits": split_name, "op": op, "G": g, "M": m, "N": n, "K": k}
    if check:
        ref_fn = {"fwd": gg.grouped_gemm, "dgrad": gg.grouped_gemm_dgrad, "wgrad": gg.grouped_gemm_wgrad}[op]
        want = ref_fn(*args, host, recipe="mxfp8", out_dtype=torch.float32, backend="reference")
        got = ref_fn(*args, splits, recipe="mxfp8", out_dtype=torch.float32, backend="hip_mxfp8")
        row["sqnr_db"] = sqnr_db(got, want)
        del want, got
    row["peer_ms"] = bench_ms(peer)
    row["hip_ms"] = bench_ms(call)
    flops = 2.0 * m * n * k
    row["peer_tflops"] = flops / row["peer_ms"] / 1e9
    row["hip_tflops"] = flops / row["hip_ms"] / 1e9
    row["ratio"] = row["peer_ms"] / row["hip_ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for hip_mxfp8.json")
    parser.add_argument("--cases", help="comma-separated case names (default: every non-decode case)")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--splits", default="balanced,skewed")
    parser.add_argument("--no-check", action="store_true", help="skip the SQNR check against reference")
    args = parser.parse_args(argv)
    started = time.time()
    reason = HipMxfp8Backend().build()
    if reason is not None:
        print(f"hip_mxfp8 did not build: {reason}", file=sys.stderr)
        return 1
    cases = [c for c in json.loads(SHAPES.read_text())["cases"] if "decode" not in c["name"]]
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = [c for c in cases if c["name"] in wanted]
    rows = []
    for case in cases:
        for split_name in args.splits.split(","):
            for op in args.ops.split(","):
                rows.append(run_case(case, split_name, op, not args.no_check))
                torch.cuda.empty_cache()
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "build": [str(r) for r in build.all_results()],
        "seconds": round(time.time() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hip_mxfp8.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(json.dumps(meta))
    print(f"{'case':26} {'splits':8} {'op':5} {'sqnr':>6} {'bf16 TF/s':>9} {'hip TF/s':>9} {'hip/bf16':>8}")
    for r in rows:
        sq = f"{r['sqnr_db']:.1f}" if "sqnr_db" in r else "-"
        print(
            f"{r['case']:26} {r['splits']:8} {r['op']:5} {sq:>6} {r['peer_tflops']:9.0f} "
            f"{r['hip_tflops']:9.0f} {r['ratio']:8.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
