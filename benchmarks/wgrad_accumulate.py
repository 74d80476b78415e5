"""wgrad accumulated into an fp32 ``main_grad`` (Megatron's fused wgrad accumulation), per backend.

``torch._grouped_mm`` cannot write fp32, so ``gg.grouped_gemm_wgrad(dy, x, splits,
out=main_grad, accumulate=True)`` goes to a backend that can: ``multistream`` (one GEMM per
group, host splits) or ``triton_grouped`` (one launch, device splits). Both are timed
through the public API, interleaved in rounds with the bf16-output wgrad of
``torch._grouped_mm`` (no accumulation) as the yardstick, and that wgrad followed by an
unfused ``main_grad.add_`` (what a user can do without this library), on the MoE cases'
splits. Issue 17's goal: ``triton_grouped`` >= 3x ``multistream`` on the 128-expert
cases and within 10 % of the bf16 wgrad.

    python benchmarks/wgrad_accumulate.py [--cases qwen3_30b_gateup,...] [--splits balanced,skewed] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

import grouped_gemm as gg
from grouped_gemm.bench.operands import make_operands
from grouped_gemm.bench.shapes import SPLIT_KINDS, parse_list, select_cases
from grouped_gemm.bench.timing import TimingPlan, median, time_in_rounds
from grouped_gemm.tools import torch_device

DEFAULT_CASES = "qwen3_30b_gateup,qwen3_30b_down,gptoss120b_gateup,gptoss120b_down,dsv3_gateup_ep8"
PLAN = TimingPlan(warmup_ms=25.0, rep_ms=120.0, min_reps=10, max_reps=300, rounds=4)
CPU_PLAN = TimingPlan(warmup_ms=1.0, rep_ms=5.0, min_reps=2, max_reps=6, rounds=1)
BACKENDS = ("triton_grouped", "multistream")
PEER = "torch._grouped_mm bf16 (no accumulate)"
PEER_ADD = "torch._grouped_mm bf16, then main_grad.add_"


def one_case(case: Any, kind: str, device: torch.device, plan: TimingPlan, seed: int) -> dict[str, Any]:
    """ms of each contender on one case; device splits for the one-launch backend, host
    splits where a backend needs them (``multistream`` reads them on the host anyway)."""
    splits = case.splits(kind)
    sets = make_operands("wgrad", case, splits, torch.bfloat16, device, seed)
    count = len(sets.sets)
    dev_splits = torch.tensor(splits, dtype=torch.int32, device=device)
    main_grad = torch.zeros(case.groups, case.n, case.k, dtype=torch.float32, device=device)
    peer = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    offs = torch.cumsum(dev_splits, 0, dtype=torch.int32)

    def accumulate(name: str) -> Any:
        arg = splits if name == "multistream" else dev_splits

        def run(i: int) -> Any:
            s = sets.sets[i % count]
            return gg.grouped_gemm_wgrad(s.a, s.b, arg, out=main_grad, accumulate=True, backend=name)

        return run

    def bf16_peer(i: int) -> Any:
        s = sets.sets[i % count]
        return peer(s.a.t(), s.b, offs=offs)

    def peer_then_add(i: int) -> Any:
        return main_grad.add_(bf16_peer(i))

    names = [*BACKENDS, PEER, PEER_ADD]
    calls = [accumulate(n) for n in BACKENDS] + [bf16_peer, peer_then_add]
    with gg.use_backends(strict=True):
        timed = time_in_rounds(calls, [count] * len(calls), device, plan)
    row: dict[str, Any] = {"case": case.name, "splits": kind, "G": case.groups, "M": case.m, "N": case.n, "K": case.k}
    for name, t in zip(names, timed, strict=True):
        row[name] = {"error": f"{type(t.error).__name__}: {t.error}"} if t.error else {"ms": median(t.times_ms)}
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=DEFAULT_CASES)
    p.add_argument("--splits", default="balanced,skewed")
    p.add_argument("--scale", type=float, default=1.0, help="multiply M, N, K (0.01: a CPU smoke run)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench-results")
    args = p.parse_args()
    device = torch_device(args.device)
    plan = PLAN if device.type == "cuda" else CPU_PLAN
    rows = [
        one_case(case, kind, device, plan, args.seed)
        for case in select_cases(args.cases, args.scale)
        for kind in parse_list(args.splits, "splits", SPLIT_KINDS)
    ]
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "wgrad_accumulate.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(meta)
    head = ("case", "splits", "triton_grouped", "multistream", "peer bf16", "peer+add_", "x multistream", "peer/tg")
    print("  ".join(f"{h:>14}" for h in head))
    for r in rows:
        ms = [r[n].get("ms") for n in (*BACKENDS, PEER, PEER_ADD)]
        cells = [f"{v:.3f}" if v else "error" for v in ms]
        speedup = f"{ms[1] / ms[0]:.2f}" if ms[0] and ms[1] else "-"
        vs_peer = f"{ms[2] / ms[0]:.2f}" if ms[0] and ms[2] else "-"
        print("  ".join(f"{c:>14}" for c in (r["case"], r["splits"], *cells, speedup, vs_peer)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
