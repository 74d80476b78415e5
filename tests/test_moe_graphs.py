"""A whole MoE step of examples/moe_layer.py under CUDA graphs (``pytest -m gpu``).

Routing changes with the input, so replaying one captured step on new tokens replays it
with new per-expert token counts (device splits, same total rows). Issue 14 asks for a
replay equal to eager: the grouped GEMMs are deterministic, but the example's own
unpermute (``index_add_``) and the gather's backward add with atomics, so whole-step
results are compared by relative error at bf16 rounding, and the splits the replay used
are checked to be the new ones.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from grouped_gemm.testing import rel_error

_spec = importlib.util.spec_from_file_location(
    "moe_layer", Path(__file__).resolve().parents[1] / "examples" / "moe_layer.py"
)
moe_layer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(moe_layer)

SIZES = {"hidden": 256, "ffn": 512, "experts": 8, "top_k": 2}
TOKENS = 512
#: bf16 outputs summed by atomics in a varying order: a few roundings of 2^-9.
TOLERANCE = 2e-2


def _block(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return moe_layer.MoEBlock(**SIZES, recipe="bf16", device="cuda")


def _counts(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    chosen = block.router(x).float().softmax(dim=-1).topk(SIZES["top_k"], dim=-1).indices
    return torch.bincount(chosen.flatten(), minlength=SIZES["experts"])


def _loss(block: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(block(x).float(), target.float())


def _eager_grads(block: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, list]:
    loss = _loss(block, x, target)
    grads = torch.autograd.grad(loss, list(block.parameters()))
    return loss.detach(), [g.detach() for g in grads]


@pytest.mark.gpu
def test_gpu_moe_step_captured_once_replays_new_routings_like_eager():
    block = _block(seed=0)
    params = list(block.parameters())
    gen = torch.Generator(device="cuda").manual_seed(1)
    inputs = [
        torch.randn(TOKENS, SIZES["hidden"], device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)
    ]
    target = torch.randn(TOKENS, SIZES["hidden"], device="cuda", dtype=torch.bfloat16, generator=gen)
    static_x = inputs[0].clone()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graph asks
        for _ in range(2):
            torch.autograd.grad(_loss(block, static_x, target), params)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")  # no host read-back anywhere in the step
    try:
        with torch.cuda.graph(graph):
            static_loss = _loss(block, static_x, target)
            static_grads = torch.autograd.grad(static_loss, params)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    seen = set()
    for x in inputs[1:]:
        static_x.copy_(x)
        for g in static_grads:
            g.fill_(float("nan"))  # poison: the replay must rewrite every gradient
        graph.replay()
        torch.cuda.synchronize()
        loss, grads = _eager_grads(block, x, target)
        assert rel_error(static_loss, loss) < TOLERANCE
        for name, (got, want) in zip(
            [n for n, _ in block.named_parameters()], zip(static_grads, grads, strict=True), strict=True
        ):
            assert torch.isfinite(got).all(), name
            assert rel_error(got, want) < TOLERANCE, name
        seen.add(tuple(_counts(block, x).tolist()))
    assert len(seen) == 2, "the inputs should route differently"


@pytest.mark.gpu
def test_gpu_moe_example_trains_under_compile_reduce_overhead():
    """``torch.compile(mode="reduce-overhead")`` (CUDA-graph trees) on the example's block:
    the same losses as eager, step by step, over a few optimizer steps."""
    eager, compiled_block = _block(seed=2), _block(seed=2)
    model = torch.compile(compiled_block, mode="reduce-overhead", fullgraph=True)
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(TOKENS, SIZES["hidden"], device="cuda", dtype=torch.bfloat16, generator=gen)
    target = torch.randn(TOKENS, SIZES["hidden"], device="cuda", dtype=torch.bfloat16, generator=gen)
    optimizers = [torch.optim.SGD(b.parameters(), lr=0.1) for b in (eager, compiled_block)]
    for step in range(4):
        losses = []
        for fn, opt in zip((eager, model), optimizers, strict=True):
            opt.zero_grad(set_to_none=True)
            loss = _loss(fn, x, target)
            loss.backward()
            opt.step()
            losses.append(loss.detach().clone())
        assert rel_error(losses[1], losses[0]) < TOLERANCE, step
