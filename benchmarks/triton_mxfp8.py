"""triton_mxfp8 fwd / dgrad / wgrad against ``torch._grouped_mm`` (bf16) on the MoE shapes.

For every case of ``benchmarks/moe_shapes.json``, balanced and skewed splits, it times with
CUDA events (``triton.testing.do_bench``, median), all with device splits:

- the peer: ``torch._grouped_mm`` on bf16 operands, group ends precomputed on the device;
- fwd / dgrad: x or dy passed pre-quantized (E4M3 MXTensor along the contraction) and the
  weight as an E4M3 ``gg.MXTensor`` quantized once (as in inference: on sm_90 the upcast
  layout is built on the first call and cached);
- wgrad: bf16 dy and x; the backend quantizes them per group along the tokens every call;

through the public API (``backend="triton_mxfp8"``), so times include validation and
dispatch; bf16 outputs like the peer's. Each op is first checked against the reference
backend on the same inputs (fp32 outputs, SQNR >= 60 dB). For fwd it also times the
alternative route on sm_90, "decode both operands to bf16, then the peer" (``alt_ms``:
weights decoded once and kept; ``alt_fresh_ms``: the weight decoded in every call too).

Run from the repository root on a GPU::

    python benchmarks/triton_mxfp8.py --out $OUT            # all 12 cases x 2 splits x 3 ops
    python benchmarks/triton_mxfp8.py --out $OUT --quick    # 4 cases, balanced

Writes ``triton_mxfp8.json`` (every number) and ``triton_mxfp8.md`` (the table printed last).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
from triton_mxfp4 import SHAPES, balanced, bench_ms, ceilings, skewed

import grouped_gemm as gg
from grouped_gemm.backends.triton_mx import launch
from grouped_gemm.mx import MXTensor, quantize_mx, quantize_mx_weight
from grouped_gemm.testing import sqnr_db

NAME = "triton_mxfp8"
DECODE = ("dsv3_gateup_decode", "qwen3_30b_gateup_decode", "gptoss120b_gateup_decode")
QUICK = ("dsv3_gateup_ep8", "qwen3_30b_gateup", "gptoss120b_gateup", "dsv3_gateup_decode")
#: Issue 11's goals, x torch._grouped_mm bf16 (decode wgrad has none).
GOALS = {("fwd", "compute"): 0.9, ("dgrad", "compute"): 0.85, ("wgrad", "compute"): 0.85}
GOALS.update({("fwd", "decode"): 1.6, ("dgrad", "decode"): 1.6})
MIN_SQNR = 60.0


def _as_rows(w: MXTensor) -> MXTensor:
    """A (G, N, K) weight blocked along K as the (G*N, K) 2-D MXTensor ``launch.dequantize`` takes."""
    g, n, k = w.shape
    return MXTensor(
        data=w.data.reshape(g * n, k), scale=w.scale.reshape(g * n, -1), fmt=w.fmt, axis=1, shape=(g * n, k)
    )


def fwd_alternative(a: MXTensor, w: MXTensor, ends: torch.Tensor) -> dict:
    """The other sm_90 route for fwd: both operands decoded to bf16, then the bf16 peer;
    with the weight decoded once and kept, and decoded in every call."""
    g, n, k = w.shape
    w_rows = _as_rows(w)
    w_bf16 = launch.dequantize(w_rows).view(g, n, k)
    kept = bench_ms(lambda: torch._grouped_mm(launch.dequantize(a), w_bf16.transpose(-2, -1), offs=ends))

    def fresh() -> torch.Tensor:
        w_now = launch.dequantize(w_rows).view(g, n, k)
        return torch._grouped_mm(launch.dequantize(a), w_now.transpose(-2, -1), offs=ends)

    return {"alt_ms": kept, "alt_fresh_ms": bench_ms(fresh), "act_decode_ms": bench_ms(lambda: launch.dequantize(a))}


def run_case(case: dict, split_name: str, ops: list[str], device: torch.device) -> list[dict]:
    g, m, n, k = case["G"], case["M"], case["N"], case["K"]
    splits = balanced(g, m) if split_name == "balanced" else skewed(g, m)
    ends = torch.tensor(splits, device=device).cumsum(0).to(torch.int32)
    dev_splits = torch.tensor(splits, device=device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device=device, dtype=torch.bfloat16)
    flops = 2 * m * n * k
    kind = "decode" if case["name"] in DECODE else "compute"
    rows = []
    for op in ops:
        extra: dict = {}
        if op == "fwd":
            a, b = quantize_mx(x, "e4m3"), quantize_mx_weight(w, "e4m3", op="fwd")
            peer = lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)  # noqa: E731
            api = gg.grouped_gemm
            extra = fwd_alternative(a, b, ends)
        elif op == "dgrad":
            a, b = quantize_mx(dy, "e4m3"), quantize_mx_weight(w, "e4m3", op="dgrad")
            peer = lambda: torch._grouped_mm(dy, w, offs=ends)  # noqa: E731
            api = gg.grouped_gemm_dgrad
        else:
            a, b = dy, x
            peer = lambda: torch._grouped_mm(dy.t(), x, offs=ends)  # noqa: E731
            api = gg.grouped_gemm_wgrad

        def call(out_dtype=torch.bfloat16, backend=NAME, a=a, b=b, api=api):
            return api(a, b, dev_splits, recipe="mxfp8", out_dtype=out_dtype, backend=backend)

        got = call(torch.float32)
        with gg.use_backends("reference", strict=True):
            want = call(torch.float32, backend="reference")
        quality = sqnr_db(got, want)
        del got, want
        peer_ms = bench_ms(peer)
        ms = bench_ms(call)
        goal = GOALS.get((op, kind))
        ratio = peer_ms / ms
        rows.append(
            {
                "case": case["name"],
                "G": g,
                "M": m,
                "N": n,
                "K": k,
                "splits": split_name,
                "op": op,
                "kind": kind,
                "peer_ms": peer_ms,
                "peer_tflops": flops / peer_ms / 1e9,
                "ms": ms,
                "tflops": flops / ms / 1e9,
                "ratio": ratio,
                "goal": goal,
                "met": None if goal is None else ratio >= goal,
                "sqnr_db": quality,
                "sqnr_ok": quality >= MIN_SQNR,
                **extra,
            }
        )
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"Run {meta['date']} on {meta['device']} (torch {meta['torch']}, triton {meta['triton']}, "
        f"commit {meta['commit']}); command: `{meta['command']}`. Ceilings measured in the run: "
        f"bf16 matmul {meta['ceilings']['bf16_tflops']:.0f} TFLOP/s, copy {meta['ceilings']['copy_gbps']:.0f} GB/s.",
        "",
        "| case | G | M | N | K | splits | op | torch._grouped_mm bf16 TFLOP/s | triton_mxfp8 TFLOP/s | x peer "
        "| goal | SQNR dB vs reference | fwd alt: decode + peer, x peer (w kept / w decoded per call) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        goal = "" if r["goal"] is None else f">= {r['goal']}x {'met' if r['met'] else 'MISSED'}"
        alt = f"{r['peer_ms'] / r['alt_ms']:.2f} / {r['peer_ms'] / r['alt_fresh_ms']:.2f}" if "alt_ms" in r else ""
        lines.append(
            f"| {r['case']} | {r['G']} | {r['M']} | {r['N']} | {r['K']} | {r['splits']} | {r['op']} | "
            f"{r['peer_tflops']:.1f} | {r['tflops']:.1f} | {r['ratio']:.2f} | {goal} | {r['sqnr_db']:.0f} | {alt} |"
        )
    met = [r for r in rows if r["goal"] is not None]
    lines += ["", f"goals met: {sum(r['met'] for r in met)} / {len(met)}; SQNR >= 60 dB: "]
    lines[-1] += f"{sum(r['sqnr_ok'] for r in rows)} / {len(rows)}"
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="directory for triton_mxfp8.json / .md")
    parser.add_argument("--cases", default="all", help="comma-separated case names, or all")
    parser.add_argument("--splits", default="balanced,skewed")
    parser.add_argument("--ops", default="fwd,dgrad,wgrad")
    parser.add_argument("--quick", action="store_true", help=f"cases {', '.join(QUICK)}, balanced splits")
    parser.add_argument("--commit", default=os.environ.get("GIT_COMMIT", "unknown"))
    parser.add_argument(
        "--smoke", action="store_true", help="one tiny case on the CPU (TRITON_INTERPRET=1): checks the script"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        device = torch.device("cpu")
        cases = [{"name": "smoke", "G": 3, "M": 40, "N": 64, "K": 128}]
    elif not torch.cuda.is_available():
        print("needs a GPU (or --smoke)", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
        cases = json.loads(SHAPES.read_text())["cases"]
    if args.quick:
        args.cases, args.splits = ",".join(QUICK), "balanced"
    if args.cases != "all" and not args.smoke:
        wanted = set(args.cases.split(","))
        cases = [c for c in cases if c["name"] in wanted]
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": args.commit,
        "command": " ".join(["python", *sys.argv]),
        "ceilings": ceilings(device) if device.type == "cuda" else {"bf16_tflops": 0.0, "copy_gbps": 0.0},
    }
    print(json.dumps(meta), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    partial = (out / "triton_mxfp8_rows.jsonl").open("w")
    rows: list[dict] = []
    start = time.time()
    for case in cases:
        for split in args.splits.split(","):
            for r in run_case(case, split, args.ops.split(","), device):
                rows.append(r)
                partial.write(json.dumps(r) + "\n")
                partial.flush()
                print(
                    f"{r['case'][:18]:18s} {r['splits'][:4]} {r['op']:5s} {r['peer_tflops']:6.1f} "
                    f"{r['tflops']:6.1f} x{r['ratio']:.2f} {r['sqnr_db']:.0f}dB {time.time() - start:.0f}s",
                    flush=True,
                )
            if device.type == "cuda":
                torch.cuda.empty_cache()
    (out / "triton_mxfp8.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = markdown(meta, rows)
    (out / "triton_mxfp8.md").write_text(table)
    print(table)
    return 0 if all(r["sqnr_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
