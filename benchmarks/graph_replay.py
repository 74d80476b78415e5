"""A GroupedLinear training step replayed from a CUDA graph against the same step run eagerly.

The step is forward + backward (dx and dW) with device splits. Three times per recipe:

- ``kernels``: the GPU time of the step's kernels and copies, summed from the profiler
  over one eager step: what the step costs with the host never in the way;
- ``eager``: wall time per step over back-to-back eager steps (CUDA events);
- ``graph``: wall time per replay over back-to-back replays of the captured step.

Issue 14's goal: ``graph`` within 5 % of ``kernels``. Capture runs with
``torch.cuda.set_sync_debug_mode("error")``, so a host sync inside the step fails the run.

    python benchmarks/graph_replay.py [--recipes bf16,a16w4,mxfp4,mxfp8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import grouped_gemm as gg
from grouped_gemm.bench.timing import back_to_back_ms

#: (name, G, K, N, tokens): a decode-sized step (host-bound eagerly) and a training-sized one.
SHAPES = (
    ("decode G=32 K=2048 N=1536 M=256", 32, 2048, 1536, 256),
    ("train G=8 K=2048 N=1536 M=8192", 8, 2048, 1536, 8192),
)


def _step(layer: gg.GroupedLinear, x: torch.Tensor, dy: torch.Tensor, splits: torch.Tensor) -> Callable[[], Any]:
    params = [x, layer.weight]

    def run() -> Any:
        return torch.autograd.grad(layer(x, splits), params, dy)

    return run


def _kernel_ms(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == cuda) / 1e3


def one(recipe: str, shape: tuple, calls: int, rounds: int) -> dict[str, Any]:
    name, groups, k, n, tokens = shape
    torch.manual_seed(0)
    layer = gg.GroupedLinear(groups, k, n, recipe=recipe, device="cuda")
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
    splits = torch.tensor(gg.skewed_splits(groups, tokens), device="cuda")
    eager = _step(layer, x, dy, splits)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            eager()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            eager()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    samples: dict[str, list[float]] = {"kernels": [], "eager": [], "graph": []}
    for _ in range(rounds):  # interleaved, so clock drift hits all three alike
        samples["kernels"].append(_kernel_ms(eager))
        samples["eager"].append(back_to_back_ms(eager, calls))
        samples["graph"].append(back_to_back_ms(graph.replay, calls))
    row = {"recipe": recipe, "shape": name, **{key: sorted(v)[len(v) // 2] for key, v in samples.items()}}
    row["graph_vs_kernels"] = row["graph"] / row["kernels"]
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="bf16,a16w4,mxfp4,mxfp8")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench-results")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_replay.py needs a CUDA GPU")
    rows = []
    for recipe in args.recipes.split(","):
        for shape in SHAPES:
            try:
                rows.append(one(recipe, shape, args.calls, args.rounds))
            except Exception as exc:  # noqa: BLE001 - a recipe that cannot be captured is reported
                rows.append({"recipe": recipe, "shape": shape[0], "error": f"{type(exc).__name__}: {exc}"[:300]})
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "grouped_gemm": gg.__version__}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "graph_replay.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(meta)
    print(f"{'recipe':<8}{'shape':<34}{'kernels ms':>11}{'eager ms':>10}{'graph ms':>10}{'graph/kernels':>15}")
    for r in rows:
        if "error" in r:
            print(f"{r['recipe']:<8}{r['shape']:<34}  {r['error']}")
            continue
        print(
            f"{r['recipe']:<8}{r['shape']:<34}{r['kernels']:>11.3f}{r['eager']:>10.3f}{r['graph']:>10.3f}"
            f"{r['graph_vs_kernels']:>15.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
