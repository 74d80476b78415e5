"""Time ``torch_grouped_mm`` against ``multistream`` (1, 2, 4 streams) on the MoE shapes.

The measurement behind the two backends' declared priorities on a GPU. For every case of
``moe_shapes.json``, balanced and skewed splits, and fwd / dgrad / wgrad in bf16, it times
each backend's ``run`` directly and through ``gg.grouped_gemm*(..., backend=name)``
(``torch_grouped_mm`` also with the splits on the device), with
``triton.testing.do_bench`` medians on random normal data; operand sets are rotated so
that they add up to several L2 caches. It prints TFLOP/s (2*M*N*K per call) and, per case
and op, which backend wins on average over both split kinds, and writes everything to
``<out>/blas_priority.json`` (``--out``, else ``$OUT``, else ``bench-results/``).

    python benchmarks/blas_priority.py [--cases dsv3_gateup_ep8,...] [--ops fwd,wgrad]
                                       [--streams 1,2,4] [--shapes PATH] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
from triton.testing import do_bench

import grouped_gemm as gg
from grouped_gemm import validation
from grouped_gemm.backends.multistream import MultistreamBackend, set_streams
from grouped_gemm.backends.torch_grouped_mm import TorchGroupedMMBackend
from grouped_gemm.testing import sqnr_db

HERE = Path(__file__).resolve().parent
#: The repo's copy first, then the shared one beside the checkout.
SHAPE_FILES = (HERE / "moe_shapes.json", HERE.parent.parent / "shared" / "moe_shapes.json")
OPS = ("fwd", "dgrad", "wgrad")
SPLIT_KINDS = ("balanced", "skewed")
#: Rotated operand sets add up to at least this many L2 caches (at most MAX_SETS sets).
ROTATE_L2 = 3
MAX_SETS = 8
TGMM = "torch_grouped_mm"
MS = "multistream"


def load_cases(path: str | None) -> list[dict[str, Any]]:
    """The cases of the first shapes file found."""
    candidates = [Path(path)] if path else list(SHAPE_FILES)
    for candidate in candidates:
        if candidate.is_file():
            return json.loads(candidate.read_text())["cases"]
    raise SystemExit(f"no moe_shapes.json at {', '.join(map(str, candidates))}; pass --shapes PATH")


def operand_sets(case: dict[str, Any], device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Random x (M, K), dy (M, N), w (G, N, K) in bf16, rotated past the L2 cache."""
    g, m, n, k = case["G"], case["M"], case["N"], case["K"]
    per_set = 2 * (m * k + m * n + g * n * k)
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    count = max(1, min(MAX_SETS, math.ceil(ROTATE_L2 * l2 / per_set)))
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)

    return [{"x": rand(m, k), "dy": rand(m, n), "w": rand(g, n, k)} for _ in range(count)]


def operands_of(op: str, data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) as the op takes them: fwd (x, w), dgrad (dy, w), wgrad (dy, x)."""
    return {"fwd": (data["x"], data["w"]), "dgrad": (data["dy"], data["w"]), "wgrad": (data["dy"], data["x"])}[op]


def api_call(op: str) -> Callable[..., torch.Tensor]:
    return {"fwd": gg.grouped_gemm, "dgrad": gg.grouped_gemm_dgrad, "wgrad": gg.grouped_gemm_wgrad}[op]


def problem_of(op: str, a: torch.Tensor, b: torch.Tensor, splits: Any) -> gg.Problem:
    """The Problem the API builds for these operands (as a backend's run receives it)."""
    if op == "wgrad":
        return validation.wgrad(a, b, splits, None, None, None, False).problem()
    return validation.fwd_or_dgrad(op, a, b, splits, None, None, None).problem()


def rotating(fn: Callable[[int], Any], sets: int) -> Callable[[], Any]:
    """A no-argument callable that moves to the next operand set on every call."""
    state = {"i": 0}

    def call() -> Any:
        state["i"] = (state["i"] + 1) % sets
        return fn(state["i"])

    return call


def variants(op: str, sets: list[dict[str, torch.Tensor]], splits: list[int], streams: list[int]) -> dict:
    """name -> (backend name, stream count or None, fn(i) running on operand set i)."""
    problem = problem_of(op, *operands_of(op, sets[0]), splits)
    device_splits = torch.tensor(splits, device=sets[0]["x"].device)
    call = api_call(op)
    tgmm = TorchGroupedMMBackend()

    def direct(backend: gg.Backend) -> Callable[[int], Any]:
        return lambda i: backend.run(problem, gg.GroupedInputs(*operands_of(op, sets[i]), splits))

    def through_api(name: str, s: Any) -> Callable[[int], Any]:
        return lambda i: call(*operands_of(op, sets[i]), s, backend=name)

    out = {
        f"{TGMM}/run": (TGMM, None, direct(tgmm)),
        f"{TGMM}/gg": (TGMM, None, through_api(TGMM, splits)),
        f"{TGMM}/gg-dev": (TGMM, None, through_api(TGMM, device_splits)),
    }
    for count in streams:
        out[f"{MS}{count}/run"] = (MS, count, direct(MultistreamBackend(streams=count)))
        out[f"{MS}{count}/gg"] = (MS, count, through_api(MS, splits))
    return out


def measure(op: str, case: dict[str, Any], kind: str, sets: list, streams: list[int]) -> dict[str, Any]:
    """Median ms and TFLOP/s of every variant for one (case, splits, op)."""
    splits = gg.balanced_splits(case["G"], case["M"]) if kind == "balanced" else gg.skewed_splits(case["G"], case["M"])
    flops = 2 * case["M"] * case["N"] * case["K"]
    row: dict[str, Any] = {"case": case["name"], "splits": kind, "op": op, **{d: case[d] for d in "GMNK"}}
    row["results"] = {}
    outputs = {}
    for name, (backend, count, fn) in variants(op, sets, splits, streams).items():
        decision = gg.explain(*operands_of(op, sets[0]), splits, op=op, backend=backend)
        if decision.selected != backend:
            reasons = "; ".join(str(r) for r in decision.candidate(backend).reasons)
            row["results"][name] = {"ineligible": reasons}
            continue
        if count is not None:
            set_streams(count)
        if backend not in outputs:
            outputs[backend] = fn(0)
        ms = do_bench(rotating(fn, len(sets)), warmup=25, rep=100, return_mode="median")
        row["results"][name] = {"ms": ms, "tflops": flops / ms / 1e9}
    if len(outputs) == 2:
        row["agree_db"] = sqnr_db(outputs[MS], outputs[TGMM].double())
    return row


def table(rows: list[dict[str, Any]], names: list[str]) -> str:
    """Fixed-width TFLOP/s table, one line per (case, splits, op)."""
    head = ["case", "splits", "op", "G", "M", "N", "K", *names, "agree dB"]
    lines = [head]
    for r in rows:
        cells = [r["case"], r["splits"], r["op"], *(str(r[d]) for d in "GMNK")]
        for name in names:
            res = r["results"].get(name, {})
            cells.append(f"{res['tflops']:.1f}" if "tflops" in res else "-")
        cells.append(f"{r['agree_db']:.1f}" if "agree_db" in r else "-")
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in lines)


def winners(rows: list[dict[str, Any]], streams: list[int]) -> list[dict[str, Any]]:
    """Per (case, op): torch_grouped_mm vs the best multistream run, mean over split kinds."""
    out = []
    for key in sorted({(r["case"], r["op"]) for r in rows}, key=lambda k: (k[0], OPS.index(k[1]))):
        both = [r for r in rows if (r["case"], r["op"]) == key]

        def mean_tflops(name: str, both: list = both) -> float | None:
            values = [r["results"].get(name, {}).get("tflops") for r in both]
            return statistics.mean(values) if all(v is not None for v in values) else None

        tgmm = mean_tflops(f"{TGMM}/gg")
        loops = {c: mean_tflops(f"{MS}{c}/gg") for c in streams}
        loops = {c: v for c, v in loops.items() if v is not None}
        best = max(loops, key=loops.get) if loops else None
        entry = {"case": key[0], "op": key[1], "G": both[0]["G"], "tgmm_tflops": tgmm, "best_streams": best}
        entry["ms_tflops"] = loops.get(best) if best else None
        if tgmm and entry["ms_tflops"]:
            entry["ms_over_tgmm"] = entry["ms_tflops"] / tgmm
        out.append(entry)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated ops (default: fwd,dgrad,wgrad)")
    parser.add_argument("--streams", default="1,2,4", help="multistream stream counts (default: 1,2,4)")
    parser.add_argument("--shapes", help="path of moe_shapes.json")
    parser.add_argument("--out", default=os.environ.get("OUT") or "bench-results", help="directory of the JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("blas_priority.py times GPU backends; no GPU is visible to torch")
    device = torch.device("cuda")
    cases = load_cases(args.shapes)
    if args.cases:
        wanted = set(args.cases.split(","))
        unknown = wanted - {c["name"] for c in cases}
        if unknown:
            raise SystemExit(f"unknown cases {sorted(unknown)}; known: {', '.join(c['name'] for c in cases)}")
        cases = [c for c in cases if c["name"] in wanted]
    ops = [op for op in args.ops.split(",") if op]
    if set(ops) - set(OPS):
        raise SystemExit(f"--ops takes {', '.join(OPS)}; got {args.ops}")
    streams = [int(s) for s in args.streams.split(",")]
    rows = []
    for case in cases:
        sets = operand_sets(case, device)
        for kind in SPLIT_KINDS:
            for op in ops:
                rows.append(measure(op, case, kind, sets, streams))
                done = rows[-1]["results"].items()
                print(f"{case['name']} {kind} {op}: " + ", ".join(f"{n} {r.get('tflops', 0):.0f}" for n, r in done))
        del sets
        torch.cuda.empty_cache()
    names = [f"{TGMM}/run", f"{TGMM}/gg", f"{TGMM}/gg-dev"]
    names += [f"{MS}{c}/{how}" for c in streams for how in ("run", "gg")]
    print("\nTFLOP/s (do_bench medians, bf16, 2*M*N*K per call)\n" + table(rows, names))
    summary = winners(rows, streams)
    print("\nper case and op, mean over balanced and skewed (through gg):")
    for s in summary:
        ratio = f"{s['ms_over_tgmm']:.2f}" if "ms_over_tgmm" in s else "-"
        print(f"  {s['case']:26s} {s['op']:6s} G={s['G']:<4d} multistream({s['best_streams']}) / {TGMM} = {ratio}")
    props = torch.cuda.get_device_properties(device)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": props.name,
        "capability": list(torch.cuda.get_device_capability(device)),
        "multiprocessors": props.multi_processor_count,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "blas_priority.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows, "summary": summary}, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
