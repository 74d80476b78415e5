"""triton_mxfp4 against ``torch._grouped_mm`` (bf16) on the MoE shapes, side by side in one run.

For every case of ``benchmarks/moe_shapes.json`` and every split pattern it times, with CUDA
events (``triton.testing.do_bench``, median):

- the peer: ``torch._grouped_mm`` on bf16 x and w, group ends precomputed on the device;
- a16w4: bf16 x, E2M1 weight passed as a ``gg.MXTensor`` (quantized once, as in inference);
- a8w4 / mxfp4: x passed pre-quantized (E4M3 / E2M1 MXTensor) as well;

all through the public API (``gg.grouped_gemm(..., backend="triton_mxfp4")``, device splits),
so times include validation and dispatch. Each result is first checked against a float64
reference on sampled groups (SQNR >= 60 dB). ``--sweep`` also times kernel configurations
on a few cases; every compiled upcast kernel's registers, spills and SASS instruction mix
are reported at the end. Run from the repository root on a GPU::

    python benchmarks/triton_mxfp4.py --out $OUT

Writes ``triton_mxfp4.json`` (every number) and ``triton_mxfp4.md`` (tables) under --out.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton
from bf16_probe import launch_bf16_probe
from triton.testing import do_bench

import grouped_gemm as gg
from grouped_gemm.backends.triton_mx import launch, layouts
from grouped_gemm.backends.triton_mx.dequant_kernel import DequantTile
from grouped_gemm.backends.triton_mx.upcast_kernel import upcast_grouped_kernel
from grouped_gemm.mx import MXTensor, quantize_mx, quantize_mx_weight
from grouped_gemm.testing import sqnr_db

SHAPES = Path(__file__).with_name("moe_shapes.json")
DECODE = ("dsv3_gateup_decode", "qwen3_30b_gateup_decode", "gptoss120b_gateup_decode")
GOALS = {"a16w4": {"decode": 3.0, "compute": 0.9}, "a8w4": {"compute": 0.7}, "mxfp4": {"compute": 0.7}}
#: --sweep: upcast configurations per case and split pattern (kernel alone, run-major
#: layout; the first configuration of each list also with the row-major layout).
DECODE_CONFIGS = [
    launch.UpcastConfig(16, 128, 4, 4, 4, 2),
    launch.UpcastConfig(16, 128, 4, 4, 6, 2),
    launch.UpcastConfig(16, 128, 4, 4, 8, 2),
    launch.UpcastConfig(16, 128, 4, 4, 6, 1),
    launch.UpcastConfig(16, 128, 4, 4, 8, 1),
    launch.UpcastConfig(32, 128, 4, 4, 4, 2),
    launch.UpcastConfig(32, 128, 4, 4, 6, 2),
    launch.UpcastConfig(16, 64, 4, 4, 8, 4),
    launch.UpcastConfig(16, 256, 4, 8, 4, 1),
]
COMPUTE_CONFIGS = [
    launch.UpcastConfig(256, 128, 2, 8, 4, 1),
    launch.UpcastConfig(256, 128, 2, 8, 3, 1),
    launch.UpcastConfig(128, 256, 2, 8, 3, 1),
    launch.UpcastConfig(128, 256, 4, 8, 3, 1),
    launch.UpcastConfig(256, 128, 4, 8, 2, 1),
    launch.UpcastConfig(128, 128, 4, 8, 4, 1),
    launch.UpcastConfig(256, 64, 4, 4, 3, 1),
]
SWEEP_CASES = {
    "qwen3_30b_gateup_decode": ("balanced",),
    "gptoss120b_gateup_decode": ("balanced",),
    "dsv3_gateup_decode": ("balanced", "skewed"),
    "dsv3_gateup_ep8": ("balanced",),
    "qwen3_30b_gateup": ("balanced", "skewed"),
    "mixtral_down": ("balanced",),
}
#: --sweep: tiles of the MX -> bf16 activation decode (its defaults, dequant_kernel.DEQUANT_TILES,
#: are 8 x 512 along axis 1 and 32 x 128 along axis 0).
DEQUANT_SWEEP = [
    DequantTile(16, 256, 4),
    DequantTile(32, 256, 4),
    DequantTile(32, 128, 4),
    DequantTile(64, 256, 8),
    DequantTile(16, 512, 8),
    DequantTile(8, 512, 4),
]
#: --sweep: bf16_probe tiles (BM, BN, BK, warps, stages) on the compute-bound sweep cases.
PROBE_TILES = [(256, 128, 64, 8, 3), (256, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 64, 8, 4)]


def skewed(groups: int, m: int, seed: int = 0) -> list[int]:
    """moe_shapes.json's skewed rule."""
    u = torch.rand(groups, generator=torch.Generator().manual_seed(seed)) ** 3 + 1e-3
    sizes = torch.floor(u / u.sum() * m).to(torch.int64)
    sizes[0] += m - int(sizes.sum())
    return [int(s) for s in sizes]


def balanced(groups: int, m: int) -> list[int]:
    sizes = [m // groups] * groups
    sizes[-1] += m - sum(sizes)
    return sizes


def bench_ms(fn) -> float:
    """Median milliseconds per call: CUDA events on a GPU, a wall clock for --smoke."""
    if torch.cuda.is_available():
        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def sampled_sqnr(out: torch.Tensor, a: torch.Tensor, wq: MXTensor, splits: list[int]) -> float:
    """SQNR of ``out`` against float64 on up to 256 rows of the first, largest and last
    non-empty groups (their weights dequantized one group at a time)."""
    live = [g for g, s in enumerate(splits) if s]
    picks = sorted({live[0], max(live, key=lambda g: splits[g]), live[-1]})
    starts = [0]
    for s in splits:
        starts.append(starts[-1] + s)
    got, want = [], []
    for g in picks:
        rows = slice(starts[g], starts[g] + min(splits[g], 256))
        w_g = MXTensor(data=wq.data[g : g + 1], scale=wq.scale[g : g + 1], fmt="e2m1", axis=2, shape=(1, *wq.shape[1:]))
        want.append(a[rows].double() @ w_g.dequantize()[0].double().T)
        got.append(out[rows].double())
    return sqnr_db(torch.cat(got), torch.cat(want))


def run_case(case: dict, split_name: str, recipes: list[str], device: torch.device) -> list[dict]:
    g, m, n, k = case["G"], case["M"], case["N"], case["K"]
    splits = balanced(g, m) if split_name == "balanced" else skewed(g, m)
    ends = torch.tensor(splits, device=device).cumsum(0).to(torch.int32)
    dev_splits = torch.tensor(splits, device=device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device=device, dtype=torch.bfloat16)
    flops = 2 * m * n * k
    if device.type == "cuda":
        peer_ms = bench_ms(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=ends))
    else:
        peer_ms = bench_ms(lambda: gg.grouped_gemm(x, w, splits, backend="reference"))
    wq = quantize_mx_weight(w, "e2m1")
    layouts.upcast_weight(wq)  # built once, as with fixed inference weights
    rows = []
    for recipe in recipes:
        fmt = {"a16w4": None, "a8w4": "e4m3", "mxfp4": "e2m1"}[recipe]
        a = x if fmt is None else quantize_mx(x, fmt)
        a_ref = x.float() if fmt is None else a.dequantize()
        dequant_ms = None if fmt is None else bench_ms(lambda a=a: launch.dequantize(a))

        def call(a=a, recipe=recipe, out_dtype=torch.bfloat16):
            return gg.grouped_gemm(a, wq, dev_splits, recipe=recipe, out_dtype=out_dtype, backend="triton_mxfp4")

        quality = sampled_sqnr(call(out_dtype=torch.float32), a_ref, wq, splits)
        ms = bench_ms(call)
        kind = "decode" if case["name"] in DECODE else "compute"
        goal = GOALS.get(recipe, {}).get(kind)
        rows.append(
            {
                "case": case["name"],
                "G": g,
                "M": m,
                "N": n,
                "K": k,
                "splits": split_name,
                "recipe": recipe,
                "kind": kind,
                "peer_ms": peer_ms,
                "peer_tflops": flops / peer_ms / 1e9,
                "ms": ms,
                "tflops": flops / ms / 1e9,
                "ratio": peer_ms / ms,
                "goal": goal,
                "met": None if goal is None else peer_ms / ms >= goal,
                "sqnr_db": quality,
                "dequant_ms": dequant_ms,
                "config": str(launch.upcast_config(m, g)),
                "weight_gbps": (wq.data.numel() + wq.scale.numel()) / ms / 1e6,
            }
        )
    return rows


def sweep_case(case: dict, split_name: str, device: torch.device) -> list[dict]:
    """Upcast-kernel configurations on one case, kernel alone, next to the peer and, on
    compute-bound cases, the bf16 probe (same schedule, no decode)."""
    g, m, n, k = case["G"], case["M"], case["N"], case["K"]
    host_splits = balanced(g, m) if split_name == "balanced" else skewed(g, m)
    splits = torch.tensor(host_splits, device=device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device=device, dtype=torch.bfloat16)
    wq = quantize_mx_weight(w, "e2m1")
    out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    flops = 2 * m * n * k
    ends = splits.cumsum(0).to(torch.int32)
    peer_ms = bench_ms(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=ends))
    results = [{"case": case["name"], "splits": split_name, "kernel": "torch._grouped_mm", "ms": peer_ms}]
    decode = case["name"] in DECODE
    for run_major in (True, False):
        lay = layouts.build_upcast_weight(wq, check_scales=True, run_major=run_major)
        for cfg in (DECODE_CONFIGS if decode else COMPUTE_CONFIGS)[: None if run_major else 1]:
            ms = bench_ms(lambda cfg=cfg, lay=lay: launch.launch_upcast(x, lay, splits, out, g, cfg))
            layout = "run-major" if run_major else "row-major"
            results.append({"case": case["name"], "splits": split_name, "kernel": f"{cfg} {layout}", "ms": ms})
        del lay
    if not decode:
        for tile in PROBE_TILES:
            ms = bench_ms(lambda tile=tile: launch_bf16_probe(x, w, splits, out, *tile))
            results.append({"case": case["name"], "splits": split_name, "kernel": f"bf16_probe{tile}", "ms": ms})
    for r in results:
        r["tflops"] = flops / r["ms"] / 1e9
        r["x_peer"] = peer_ms / r["ms"]
        print(f"sweep {r['case'][:18]:18s} {split_name[:4]} {r['kernel']:70s} {r['tflops']:6.1f} x{r['x_peer']:.2f}")
    torch.cuda.empty_cache()
    return results


def dequant_sweep(device: torch.device) -> list[dict]:
    """The activation decode on a 16384 x 7168 bf16 tensor per format and block axis, every
    tile of DEQUANT_SWEEP; bandwidth = codes and scales read + bf16 written."""
    x = torch.randn(16384, 7168, device=device, dtype=torch.bfloat16)
    results = []
    for fmt in ("e4m3", "e2m1"):
        for axis in (1, 0):
            q = quantize_mx(x, fmt, axis=axis)
            moved = q.data.numel() * q.data.element_size() + q.scale.numel() + 2 * x.numel()
            for tile in DEQUANT_SWEEP:
                if (tile.br, tile.bc)[axis] % 32:
                    continue
                ms = bench_ms(lambda q=q, tile=tile: launch.dequantize(q, tile=tile))
                results.append({"fmt": fmt, "axis": axis, "tile": str(tile), "ms": ms, "tb_s": moved / ms / 1e9})
                print(f"dequant {fmt} axis {axis} {tile} {ms * 1e3:.1f} us {moved / ms / 1e9:.2f} TB/s", flush=True)
    return results


def kernel_stats() -> list[dict]:
    """Registers, spills and the SASS instruction mix of every compiled upcast kernel."""
    stats = []
    nvdisasm = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    for cache in upcast_grouped_kernel.device_caches.values():
        for kernel in cache[0].values():
            meta = kernel.metadata
            entry = {
                "warps": meta.num_warps,
                "stages": meta.num_stages,
                "regs": kernel.n_regs,
                "spills": kernel.n_spills,
            }
            names = upcast_grouped_kernel.arg_names
            constants = getattr(kernel.src, "constants", {})
            entry["constants"] = {names[k[0]]: v for k, v in constants.items() if names[k[0]].isupper()}
            entry["shared"] = meta.shared
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(kernel.asm["cubin"])
                f.flush()
                sass = subprocess.run([str(nvdisasm), "-sass", f.name], capture_output=True, text=True).stdout
            ops = collections.Counter(
                re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass, re.M)
            )
            entry["sass_top"] = dict(ops.most_common(12))
            stats.append(entry)
    return stats


def ceilings(device: torch.device) -> dict:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    mm = bench_ms(lambda: a @ b)
    src = torch.empty(1 << 29, device=device, dtype=torch.int16)
    dst = torch.empty_like(src)
    cp = bench_ms(lambda: dst.copy_(src))
    return {"bf16_tflops": 2 * 8192**3 / mm / 1e9, "copy_gbps": 2 * src.numel() * 2 / cp / 1e6}


def markdown(meta: dict, rows: list[dict], sweep: list[dict], dequant: list[dict], stats: list[dict]) -> str:
    lines = [
        f"Run {meta['date']} on {meta['device']} (torch {meta['torch']}, triton {meta['triton']}, "
        f"commit {meta['commit']}); command: `{meta['command']}`. Ceilings measured in the run: "
        f"bf16 matmul {meta['ceilings']['bf16_tflops']:.0f} TFLOP/s, copy {meta['ceilings']['copy_gbps']:.0f} GB/s.",
        "",
        "| case | G | M | N | K | splits | recipe | torch._grouped_mm bf16 TFLOP/s | triton_mxfp4 TFLOP/s "
        "| x peer | goal | SQNR dB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        goal = "" if r["goal"] is None else f">= {r['goal']}x {'met' if r['met'] else 'MISSED'}"
        lines.append(
            f"| {r['case']} | {r['G']} | {r['M']} | {r['N']} | {r['K']} | {r['splits']} | {r['recipe']} | "
            f"{r['peer_tflops']:.1f} | {r['tflops']:.1f} | {r['ratio']:.2f} | {goal} | {r['sqnr_db']:.0f} |"
        )
    if sweep:
        lines += ["", "| sweep case | splits | kernel | ms | TFLOP/s | x peer |", "|---|---|---|---|---|---|"]
        lines += [
            f"| {s['case']} | {s['splits']} | {s['kernel']} | {s['ms']:.4f} | {s['tflops']:.1f} | {s['x_peer']:.2f} |"
            for s in sweep
        ]
    if dequant:
        lines += ["", "| decode | axis | tile | us | TB/s |", "|---|---|---|---|---|"]
        lines += [
            f"| {d['fmt']} | {d['axis']} | {d['tile']} | {d['ms'] * 1e3:.1f} | {d['tb_s']:.2f} |" for d in dequant
        ]
    if stats:
        lines += ["", "| kernel | warps | stages | regs | spills | smem | SASS top |", "|---|---|---|---|---|---|---|"]
        lines += [
            f"| {s['constants']} | {s['warps']} | {s['stages']} | {s['regs']} | {s['spills']} | {s['shared']} | "
            f"{s['sass_top']} |"
            for s in stats
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="directory for triton_mxfp4.json / .md")
    parser.add_argument("--cases", default="all", help="comma-separated case names, or all")
    parser.add_argument("--splits", default="balanced,skewed")
    parser.add_argument("--recipes", default="a16w4,a8w4,mxfp4")
    parser.add_argument("--sweep", action="store_true", help="also time upcast configurations")
    parser.add_argument("--sweep-cases", default=",".join(SWEEP_CASES), help="comma-separated cases to sweep")
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
    if args.cases != "all":
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
    partial = (out / "triton_mxfp4_rows.jsonl").open("w")
    rows: list[dict] = []
    start = time.time()
    for case in cases:
        for split in args.splits.split(","):
            with gg.use_backends("triton_mxfp4", strict=True):
                case_rows = run_case(case, split, args.recipes.split(","), device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            for r in case_rows:
                rows.append(r)
                partial.write(json.dumps(r) + "\n")
                partial.flush()
                print(
                    f"{r['case'][:18]:18s} {r['splits'][:4]} {r['recipe']:5s} {r['peer_tflops']:6.1f} "
                    f"{r['tflops']:6.1f} x{r['ratio']:.2f} {r['sqnr_db']:.0f}dB {time.time() - start:.0f}s",
                    flush=True,
                )
    sweep = []
    if args.sweep and device.type == "cuda":
        wanted_sweep = set(args.sweep_cases.split(","))
        for case in (
            c for c in json.loads(SHAPES.read_text())["cases"] if c["name"] in wanted_sweep & set(SWEEP_CASES)
        ):
            for split in SWEEP_CASES[case["name"]]:
                sweep += sweep_case(case, split, device)
    dequant = dequant_sweep(device) if args.sweep and device.type == "cuda" else []
    stats = kernel_stats() if device.type == "cuda" else []
    (out / "triton_mxfp4.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "sweep": sweep, "dequant": dequant, "stats": stats}, indent=1)
    )
    (out / "triton_mxfp4.md").write_text(markdown(meta, rows, sweep, dequant, stats))
    for entry in stats:
        print(f"kernel {entry['constants']} regs {entry['regs']} spills {entry['spills']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
