"""Expert parallelism over torch.distributed: check against one process, then time the parts.

Every rank builds the same single-process MoE layer (before joining the process group, so
it is a plain local layer) and runs it on the whole batch; then the expert-parallel layer,
loaded with the same experts (``load_full_state_dict``), runs this rank's share of the
tokens (uneven on purpose). Output, input gradient and every weight gradient are compared;
any mismatch exits with status 1. Then a short benchmark times, per rank, a forward +
backward step of the layer and, separately with the same routing, its all-to-all
exchanges (dispatch and combine, forward and backward) and its grouped GEMMs (gate-up,
activation, down, forward and backward). It prints a table and writes JSON into ``--out``.

    torchrun --standalone --nproc-per-node 2 examples/expert_parallel.py                # CPU: gloo
    torchrun --standalone --nproc-per-node 2 examples/expert_parallel.py --model qwen3_30b_a3b \\
        --tokens 8192 --recipe bf16 --out results/                                       # GPUs: NCCL

With GPUs each rank uses the GPU of its local rank and NCCL; without, gloo on the CPU.
The check compares fp32 (``--recipe fp32``, the default) to a relative error of 1e-5,
16-bit recipes to 2e-2 (``--model`` shapes are large: check those with ``--recipe bf16``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from grouped_gemm.bench.shapes import shapes_document
from grouped_gemm.parallel import ExpertParallelMoE, all_to_all

TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 2e-2}
SMALL = {"experts": 8, "hidden": 64, "ffn": 48, "top_k": 2}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        default=None,
        choices=sorted(shapes_document()["models"]),
        help="a model of grouped_gemm/bench/moe_shapes.json (default: small)",
    )
    parser.add_argument("--tokens", type=int, default=64, help="mean tokens per rank")
    parser.add_argument("--recipe", default="fp32", choices=sorted(TOLERANCE))
    parser.add_argument("--bench-iters", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=120, help="seconds before a collective gives up")
    parser.add_argument("--out", type=Path, default=None, help="folder for expert_parallel.json (rank 0 writes it)")
    return parser.parse_args()


def model_sizes(name: str | None) -> dict[str, int]:
    if name is None:
        return dict(SMALL)
    m = shapes_document()["models"][name]
    return {"experts": m["experts"], "hidden": m["hidden"], "ffn": m["intermediate"], "top_k": m["top_k"]}


def tokens_per_rank(mean: int, world: int) -> list[int]:
    """Uneven on purpose: rank r gets about (r + 1) / (world + 1) * 2 * mean tokens."""
    counts = [2 * mean * (r + 1) // (world + 1) for r in range(world)]
    counts[-1] += mean * world - sum(counts)
    return counts


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item() if want.numel() else 0.0


def check(layer: ExpertParallelMoE, ref: ExpertParallelMoE, x_all, y_all, dy_all, rows: slice) -> dict[str, float]:
    """Relative errors of the expert-parallel layer against the single-process one."""
    x = x_all.detach()[rows].clone().requires_grad_(True)
    y = layer(x)
    (y * dy_all[rows]).sum().backward()
    errors = {"out": rel(y.detach(), y_all[rows]), "x.grad": rel(x.grad, x_all.grad[rows])}
    router = layer.router.weight.grad.clone()
    dist.all_reduce(router)  # each rank's router gradient covers its own tokens
    errors["router.weight.grad"] = rel(router, ref.router.weight.grad)
    for key, param in layer.named_parameters():
        if not key.startswith("router."):
            parts = [torch.empty_like(param.grad) for _ in range(layer.world_size)]
            dist.all_gather(parts, param.grad.contiguous())
            errors[f"{key}.grad"] = rel(torch.cat(parts), ref.get_parameter(key).grad)
    return errors


def timed(fn: Callable[[], None], iters: int, device: torch.device) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs, all ranks starting together."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()  # warm-up
    times = []
    for _ in range(iters):
        sync()
        dist.barrier()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def bench(layer: ExpertParallelMoE, x: torch.Tensor, iters: int) -> dict[str, float]:
    """One rank's times: the whole step and, with the same routing, its two parts alone."""
    dy = torch.randn_like(x)
    r = layer.route(x)
    rows = x[r.token].detach().requires_grad_(True)
    received = all_to_all(rows, r.send_splits, r.recv_splits, layer.group).detach()
    grouped = (received if r.order is None else received[r.order]).requires_grad_(True)
    dy_grouped = torch.randn(grouped.shape[0], layer.hidden, dtype=x.dtype, device=x.device)

    def step() -> None:
        (layer(x.detach().requires_grad_(True)) * dy).sum().backward()

    def exchanges() -> None:  # dispatch + combine, forward and backward: four all-to-alls
        sent = all_to_all(rows, r.send_splits, r.recv_splits, layer.group)
        back = all_to_all(sent, r.recv_splits, r.send_splits, layer.group)
        back.sum().backward()

    def gemms() -> None:  # gate-up, activation, down; dgrad and wgrad of both
        (layer.experts(grouped, r.expert_splits) * dy_grouped).sum().backward()

    # Rows leaving this rank per step: dispatch and combine-backward send what this rank
    # routed, combine and dispatch-backward what it received; rows it keeps do not count.
    kept = r.send_splits[layer.rank]
    rows_out = 2 * (sum(r.send_splits) - kept) + 2 * (sum(r.recv_splits) - kept)
    return {
        "tokens": x.shape[0],
        "rows_sent": sum(r.send_splits),
        "rows_received": sum(r.recv_splits),
        "all_to_all_mbytes_out": rows_out * layer.hidden * x.element_size() / 1e6,
        "step_ms": timed(step, iters, x.device),
        "all_to_all_ms": timed(exchanges, iters, x.device),
        "grouped_gemm_ms": timed(gemms, iters, x.device),
    }


def main() -> int:
    args = parse_args()
    if "RANK" not in os.environ:
        print("run me with torchrun, e.g. torchrun --standalone --nproc-per-node 2 " + __file__, file=sys.stderr)
        return 2
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    sizes = model_sizes(args.model)
    counts = tokens_per_rank(args.tokens, world)
    rows = slice(sum(counts[:rank]), sum(counts[: rank + 1]))
    layer_args = (sizes["experts"], sizes["hidden"], sizes["ffn"], sizes["top_k"])

    # The reference: built before the process group exists, so it is a single-process layer.
    torch.manual_seed(0)
    ref = ExpertParallelMoE(*layer_args, recipe=args.recipe, device=device)
    dtype = ref.router.weight.dtype
    x_all = torch.randn(sum(counts), sizes["hidden"], dtype=dtype, device=device, requires_grad=True)
    dy_all = torch.randn(sum(counts), sizes["hidden"], dtype=dtype, device=device)
    y_all = ref(x_all)
    (y_all * dy_all).sum().backward()

    # all-to-all uses no NVLink multicast (NVLS); keep it off for the whole job.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, timeout=timedelta(seconds=args.timeout), device_id=device if device.type == "cuda" else None
    )
    try:
        layer = ExpertParallelMoE(*layer_args, recipe=args.recipe, device=device)
        layer.load_full_state_dict(ref.state_dict())
        errors = check(layer, ref, x_all, y_all.detach(), dy_all, rows)
        bad = {k: v for k, v in errors.items() if not v < TOLERANCE[args.recipe]}
        worst = max(errors, key=errors.get)
        print(
            f"rank {rank}: experts {layer.expert_range.start}..{layer.expert_range.stop - 1}, {counts[rank]} tokens, "
            f"largest relative error {errors[worst]:.2e} ({worst})",
            flush=True,
        )
        mismatch = torch.tensor([1 if bad else 0], device=device)
        dist.all_reduce(mismatch)
        if mismatch.item():
            print(f"rank {rank}: MISMATCH against the single-process layer: {bad}", file=sys.stderr, flush=True)
            return 1
        if rank == 0:
            print(f"{world} ranks ({backend}, {args.recipe}): matches the single-process layer", flush=True)

        x = x_all.detach()[rows]
        del ref, x_all, y_all, dy_all  # the benchmark needs only this rank's layer and tokens
        times = bench(layer, x, args.bench_iters)
        report = [None] * world
        dist.all_gather_object(report, {"rank": rank, **times})
        if rank == 0:
            print_table(report, sizes, args, backend)
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                meta = {"backend": backend, "device": str(device), "world": world, "recipe": args.recipe}
                meta |= {"model": args.model or "small", **sizes, "torch": torch.__version__}
                if device.type == "cuda":
                    meta["gpu"] = torch.cuda.get_device_name(device)
                (args.out / "expert_parallel.json").write_text(json.dumps({**meta, "ranks": report}, indent=1))
        return 0
    finally:
        dist.destroy_process_group()


def print_table(report: list[dict], sizes: dict[str, int], args: argparse.Namespace, backend: str) -> None:
    print(
        f"\nper-rank times, median of {args.bench_iters} (model {args.model or 'small'} {sizes}, {args.recipe}, "
        f"{backend}); the all-to-all and grouped-GEMM columns are timed apart from the step"
    )
    print(
        f"{'rank':>4} {'tokens':>7} {'rows out':>9} {'rows in':>8} {'a2a MB out':>10} "
        f"{'step ms':>8} {'a2a ms':>8} {'gemm ms':>8}"
    )
    for r in report:
        print(
            f"{r['rank']:>4} {r['tokens']:>7} {r['rows_sent']:>9} {r['rows_received']:>8} "
            f"{r['all_to_all_mbytes_out']:>10.2f} {r['step_ms']:>8.2f} {r['all_to_all_ms']:>8.2f} "
            f"{r['grouped_gemm_ms']:>8.2f}"
        )


if __name__ == "__main__":
    sys.exit(main())
