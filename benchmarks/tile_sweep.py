"""Every kernel tile config the Triton backends offer autotuning, against their default and ``torch._grouped_mm``.

For each case of ``moe_shapes.json`` (``--cases``, default all 12), split (``--splits``)
and op (``--ops``), and each backend / recipe below, it builds the Problem dispatch would
(``gg.explain`` on the call's tensors, device splits), asks the backend for
``configs(problem)`` and times ``run_config`` with each, interleaved in rounds with
``torch._grouped_mm`` on bf16 operands of the same problem (``grouped_gemm.bench.timing``:
CUDA events, median per contender, operand sets rotated past the L2):

- ``triton_grouped``, bf16: fwd, dgrad, wgrad to a new bf16 result, and wgrad accumulated
  into an fp32 ``main_grad`` (``accumulate=True``);
- ``triton_mxfp4``: a16w4 (fwd, dgrad) and mxfp4; ``triton_mxfp8``: mxfp8. Weights and
  activations are bf16 tensors quantized in every call, as in training (``--mx-weights
  prequantized``: fwd / dgrad weights handed in as MXTensors, as inference runs). Their wgrad is
  timed accumulating into fp32: on sm_90 a new bf16 wgrad result goes to
  ``torch._grouped_mm`` (the vendor route), which has no tiles to tune.

The backend is called directly, not through dispatch, so each time is that kernel with
those tiles (quantization and layout work included). Before timing, every config runs once
on the first operand set (compiling it) and is compared with the default config's result
(``MAX_REL_VS_DEFAULT``); a config that fails or disagrees is reported and not timed. The
default is the first config offered (the hooks put it first); it is timed a second time as
the last contender, a control: ``default / control`` near 1 says the harness timed first
and last alike (docs/performance.md, the ninth session's tile sweeps). ``--max-seconds`` stops
starting sweeps after that long and writes what it has.

Run from the repository root on a GPU::

    python benchmarks/tile_sweep.py --out $OUT                 # 12 cases x 2 splits x 3 ops
    python benchmarks/tile_sweep.py --out $OUT --quick         # 4 cases, balanced, < 10 min
    python benchmarks/tile_sweep.py --cases dsv3_gateup_ep8 --ops fwd --backends triton_grouped

Writes ``<out>/tile_sweep.json`` (every config's time) and ``tile_sweep.md`` (the table
printed last); ``tile_sweep_rows.jsonl`` grows as sweeps finish.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import grouped_gemm as gg
from grouped_gemm.bench import peer
from grouped_gemm.bench.operands import Operands, OperandSets, make_operands
from grouped_gemm.bench.shapes import SPLIT_KINDS, Case, parse_list, select_cases
from grouped_gemm.bench.timing import TimingPlan, median, time_in_rounds
from grouped_gemm.inputs import GroupedInputs
from grouped_gemm.registry import registry
from grouped_gemm.testing import rel_error
from grouped_gemm.tools import prequantized_weight

OPS = ("fwd", "dgrad", "wgrad")
QUICK_CASES = "dsv3_gateup_ep8,qwen3_30b_gateup,gptoss120b_gateup,gptoss120b_gateup_decode"
PLAN = TimingPlan(warmup_ms=10.0, rep_ms=60.0, min_reps=5, max_reps=200, rounds=3)
QUICK_PLAN = TimingPlan(warmup_ms=5.0, rep_ms=25.0, min_reps=3, max_reps=100, rounds=2)
QUICK_MAX_SECONDS = 500.0
#: A config's result against the default config's on the same inputs: bf16 results (one
#: rounding each) of fp32 sums in another order.
MAX_REL_VS_DEFAULT = 1e-2


@dataclasses.dataclass(frozen=True)
class Variant:
    """One backend and recipe on some ops; ``accumulate``: wgrad into an fp32 ``main_grad``."""

    backend: str
    recipe: str
    ops: tuple[str, ...]
    accumulate: bool = False

    @property
    def label(self) -> str:
        return f"{self.backend}/{self.recipe}" + (" +=fp32" if self.accumulate else "")


VARIANTS = (
    Variant("triton_grouped", "bf16", OPS),
    Variant("triton_grouped", "bf16", ("wgrad",), accumulate=True),
    Variant("triton_mxfp4", "a16w4", ("fwd", "dgrad")),
    Variant("triton_mxfp4", "mxfp4", ("fwd", "dgrad")),
    Variant("triton_mxfp4", "mxfp4", ("wgrad",), accumulate=True),
    Variant("triton_mxfp8", "mxfp8", ("fwd", "dgrad")),
    Variant("triton_mxfp8", "mxfp8", ("wgrad",), accumulate=True),
)


def variants(ops: list[str], backends: list[str]) -> list[tuple[str, Variant]]:
    """(op, variant) pairs to sweep, in ``OPS`` then ``VARIANTS`` order."""
    return [(op, v) for op in OPS if op in ops for v in VARIANTS if op in v.ops and v.backend in backends]


def config_label(config: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in config.items())


def summarize(config_ms: list[float | None], peer_ms: float | None, control_ms: float | None = None) -> dict[str, Any]:
    """Default (index 0) and best config of one sweep from their median ms (None: not
    timed), with the speedup of the best over the default and both against the peer
    (``peer_ms / ms``: above 1 is faster than ``torch._grouped_mm``); ``control_ms``: the
    default timed again as the last contender, and ``default_x_control`` its time over that
    (1.0 where the harness treats first and last alike)."""
    timed = [(ms, i) for i, ms in enumerate(config_ms) if ms is not None and math.isfinite(ms)]
    if not timed:
        return {"default_ms": None, "best": None, "best_ms": None, "speedup": None, "x_peer": None}
    best_ms, best = min(timed)
    default_ms = config_ms[0]
    return {
        "default_ms": default_ms,
        "best": best,
        "best_ms": best_ms,
        "speedup": default_ms / best_ms if default_ms else None,
        "x_peer": peer_ms / best_ms if peer_ms else None,
        "default_x_peer": peer_ms / default_ms if peer_ms and default_ms else None,
        "control_ms": control_ms,
        "default_x_control": default_ms / control_ms if default_ms and control_ms else None,
    }


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table: one line per sweep."""
    lines = [
        "| case | splits | op | backend/recipe | configs | default ms | best config | best ms | "
        "x default | x torch._grouped_mm (default / best) | default / control |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['case']} | {r['splits']} | {r['op']} | {r['variant']} |"
        if r.get("error"):
            lines.append(f"{head} {r['error']} | | | | | | |")
            continue
        best = "-" if r["best"] is None else config_label(r["configs"][r["best"]]["config"])
        peer_cell = f"{_cell(r.get('default_x_peer'), '.2f')} / {_cell(r['x_peer'], '.2f')}"
        lines.append(
            f"{head} {len(r['configs'])} | {_cell(r['default_ms'], '.3f')} | {best} | {_cell(r['best_ms'], '.3f')} | "
            f"{_cell(r['speedup'], '.2f')} | {peer_cell} | {_cell(r.get('default_x_control'), '.2f')} |"
        )
    return "\n".join(lines) + "\n"


def _result(backend: Any, problem: gg.Problem, s: Any, splits: torch.Tensor, config: dict, acc_out: Any) -> Any:
    out = None if acc_out is None else torch.zeros_like(acc_out)
    return backend.run_config(problem, GroupedInputs(s.a, s.b, splits, out), config)


def with_mx_weights(sets: OperandSets, recipe: str, op: str) -> OperandSets:
    """The sets with each weight replaced by its MXTensor for ``op`` (the inference path:
    the kernel alone, no weight preparation in the timed call); new sets, so the bf16
    variants of the same problem keep their bf16 weights."""
    return OperandSets([Operands(s.a, prequantized_weight(s.b, recipe, op)) for s in sets.sets], sets.splits)


def sweep(
    case: Case,
    kind: str,
    op: str,
    v: Variant,
    sets: OperandSets,
    device: torch.device,
    plan: TimingPlan,
    prequantized: bool = False,
) -> dict[str, Any]:
    """One (problem, backend, recipe): every offered config checked, then timed with the peer
    (on the bf16 sets: the peer multiplies bf16 operands)."""
    row: dict[str, Any] = {"case": case.name, "splits": kind, "op": op, "variant": v.label}
    peer_sets = sets
    if prequantized and op != "wgrad" and gg.get_recipe(v.recipe).is_mx:
        sets = with_mx_weights(sets, v.recipe, op)
        row["variant"] += " w:prequantized"
    row.update(G=case.groups, M=case.m, N=case.n, K=case.k)
    first, count = sets.first, len(sets.sets)
    splits = torch.tensor(sets.splits, dtype=torch.int32, device=device)
    out = torch.zeros(case.groups, case.n, case.k, dtype=torch.float32, device=device) if v.accumulate else None
    out_dtype = torch.float32 if v.accumulate else None
    decision = gg.explain(
        first.a, first.b, splits, op=op, recipe=v.recipe, out=out, out_dtype=out_dtype, accumulate=v.accumulate
    )
    reasons = decision.candidate(v.backend).reasons
    if reasons:
        return {**row, "error": "ineligible: " + "; ".join(str(r) for r in reasons)}
    problem = decision.problem
    backend = registry().get(v.backend).backend
    configs = backend.configs(problem)
    if not configs:
        return {**row, "error": "no configs offered"}
    entries: list[dict[str, Any]] = [{"config": c} for c in configs]
    want = None
    for e in entries:  # compile and check each once; failures are not timed
        try:
            got = _result(backend, problem, first, splits, e["config"], out)
            want = got if want is None else want
            e["rel_vs_default"] = rel_error(got, want)
            if not e["rel_vs_default"] <= MAX_REL_VS_DEFAULT:
                e["error"] = f"disagrees with the default: relative error {e['rel_vs_default']:.2e}"
        except Exception as exc:  # noqa: BLE001 - a config that cannot compile or run is reported
            e["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        if e is entries[0] and "error" in e:
            return {**row, "error": f"default config failed: {e['error']}", "configs": entries}
    live = [e for e in entries if "error" not in e]

    def runner(config: dict[str, Any]) -> Any:
        def run(i: int) -> Any:
            s = sets.sets[i % count]
            return backend.run_config(problem, GroupedInputs(s.a, s.b, splits, out), config)

        return run

    calls = [runner(e["config"]) for e in live]
    calls.append(peer.runner(op, peer_sets.sets, peer.group_ends(sets.splits, device)))
    calls.append(runner(entries[0]["config"]))  # the control: the default again, last
    timed = time_in_rounds(calls, [count] * len(calls), device, plan)
    control = timed.pop()
    for e, t in zip(live, timed, strict=False):
        if t.error is not None:
            e["error"] = f"{type(t.error).__name__}: {str(t.error)[:300]}"
        else:
            e["ms"] = median(t.times_ms)
    peer_t = timed[-1]
    peer_ms = None if peer_t.error is not None else median(peer_t.times_ms)
    control_ms = None if control.error is not None else median(control.times_ms)
    summary = summarize([e.get("ms") for e in entries], peer_ms, control_ms)
    return {**row, "peer_ms": peer_ms, "configs": entries, **summary}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="all", help="comma-separated case names of moe_shapes.json, or all")
    p.add_argument("--splits", default="balanced,skewed")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--backends", default="triton_grouped,triton_mxfp4,triton_mxfp8")
    p.add_argument("--quick", action="store_true", help=f"cases {QUICK_CASES}, balanced, lighter timing")
    p.add_argument(
        "--max-seconds", type=float, help=f"start no sweep after this long (--quick: {QUICK_MAX_SECONDS:.0f})"
    )
    p.add_argument(
        "--mx-weights",
        choices=("per-call", "prequantized"),
        default="per-call",
        help="MX fwd / dgrad weights: bf16 quantized inside each call (training) or an MXTensor (inference)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench-results")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        print("tile_sweep.py needs a CUDA GPU and compiled Triton (TRITON_INTERPRET unset)", file=sys.stderr)
        return 2
    if (why := peer.available()) is not None:
        print(f"tile_sweep.py compares with torch._grouped_mm: {why}", file=sys.stderr)
        return 2
    if args.quick:
        args.cases, args.splits = QUICK_CASES, "balanced"
    budget = args.max_seconds if args.max_seconds is not None else (QUICK_MAX_SECONDS if args.quick else math.inf)
    plan = QUICK_PLAN if args.quick else PLAN
    device = torch.device("cuda")
    backends = parse_list(args.backends, "backends", tuple(dict.fromkeys(v.backend for v in VARIANTS)))
    todo = variants(parse_list(args.ops, "ops", OPS), backends)
    cases, kinds = select_cases(args.cases), parse_list(args.splits, "splits", SPLIT_KINDS)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "command": " ".join(["python", *sys.argv]),
        "plan": dataclasses.asdict(plan),
    }
    print(json.dumps(meta), flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    start, stopped = time.monotonic(), None
    with (out_dir / "tile_sweep_rows.jsonl").open("w") as partial:
        for case in cases:
            for kind in kinds:
                for op in dict.fromkeys(op for op, _ in todo):
                    if time.monotonic() - start > budget:
                        stopped = f"--max-seconds {budget:g} reached before {case.name} {kind} {op}"
                        break
                    sets = make_operands(op, case, case.splits(kind), torch.bfloat16, device, args.seed)
                    for _, v in (t for t in todo if t[0] == op):
                        r = sweep(case, kind, op, v, sets, device, plan, args.mx_weights == "prequantized")
                        rows.append(r)
                        partial.write(json.dumps(r) + "\n")
                        partial.flush()
                        best = "-" if r.get("best") is None else config_label(r["configs"][r["best"]]["config"])
                        took = time.monotonic() - start
                        print(f"{case.name} {kind} {op} {v.label}: {r.get('error') or best} ({took:.0f} s)", flush=True)
                    del sets
                    torch.cuda.empty_cache()
                if stopped:
                    break
            if stopped:
                break
    meta["stopped"] = stopped
    meta["seconds"] = round(time.monotonic() - start, 1)
    (out_dir / "tile_sweep.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    text = table(rows) + (f"\nstopped early: {stopped}\n" if stopped else "")
    (out_dir / "tile_sweep.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
