"""MX GroupedLinear under CUDA graphs and with host syncs forbidden (``pytest -m gpu``).

The weights are quantized inside every call, so a captured training step re-quantizes
them on replay: after an in-place optimizer update the replay must equal eager, bit for
bit (outputs, dx, dW). And no MX step may read anything back to the host (checked with
``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronizing call).
"""

from __future__ import annotations

import pytest
import torch

import grouped_gemm as gg

MX_RECIPES = ("mxfp4", "a16w4", "a8w4", "mxfp8")
# Qwen3-30B-A3B-like gate-up, scaled down: N and K multiples of 128 and 32, one empty group.
G, N, K = 8, 384, 512
SPLITS = [300, 0, 129, 64, 1, 200, 33, 297]


def _layer(recipe: str, seed: int) -> gg.GroupedLinear:
    torch.manual_seed(seed)
    return gg.GroupedLinear(G, K, N, recipe=recipe, device="cuda")


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    m = sum(SPLITS)
    x = torch.randn(m, K, generator=gen).bfloat16().cuda()
    dy = torch.randn(m, N, generator=gen).bfloat16().cuda()
    return x, dy, torch.tensor(SPLITS, device="cuda")


def _eager(layer: gg.GroupedLinear, x: torch.Tensor, dy: torch.Tensor, splits: torch.Tensor):
    """Output, dx and dW of one eager step (``autograd.grad``: no ``.grad`` is touched)."""
    xe = x.detach().clone().requires_grad_()
    y = layer(xe, splits)
    dx, dw = torch.autograd.grad(y, (xe, layer.weight), dy)
    return y.detach(), dx, dw


def _skip_without_capturable_backends(recipe: str, err: gg.BackendUnavailableError) -> None:
    pytest.skip(f"{recipe}: no capturable backend for one of its ops on this GPU yet: {err}")


def _host_split_backends() -> list[str]:
    """Backends the calls so far went to that read ``m_splits`` on the host (a sync)."""
    host = {b.name for b in gg.list_backends() if b.spec.host_splits}
    return sorted(host & set(gg.dispatch_stats()["selected"]))


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", MX_RECIPES)
def test_gpu_graph_replay_after_weight_update_equals_eager(recipe):
    layer = _layer(recipe, seed=1)
    x, dy, splits = _inputs(seed=2)
    static_x = x.clone().requires_grad_()
    # Warm up on a side stream (Triton compiles and autotunes here, not inside capture).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            for _ in range(2):
                layer(static_x, splits).backward(dy)
        torch.cuda.current_stream().wait_stream(side)
        static_x.grad = layer.weight.grad = layer.bias.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = layer(static_x, splits)
            static_y.backward(dy)
    except gg.BackendUnavailableError as err:
        _skip_without_capturable_backends(recipe, err)
    for step in range(3):
        with torch.no_grad():  # an optimizer step outside the graph, in place
            layer.weight.add_(torch.randn_like(layer.weight), alpha=0.05 * (step + 1))
            static_x.copy_(x * (step + 1))
        graph.replay()
        y, dx, dw = _eager(layer, static_x, dy, splits)
        assert not torch.isnan(y).any()
        assert torch.equal(static_y, y), (recipe, step, (static_y.float() - y.float()).abs().max())
        assert torch.equal(static_x.grad, dx), (recipe, step)
        assert torch.equal(layer.weight.grad, dw), (recipe, step)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", MX_RECIPES)
def test_gpu_mx_step_does_not_sync(recipe):
    """fwd + bwd + SGD with device splits, fresh weights every step, syncs forbidden."""
    layer = _layer(recipe, seed=3)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.01)
    x, dy, splits = _inputs(seed=4)
    x.requires_grad_()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        layer(x, splits).backward(dy)
        optimizer.step()

    step()  # warm-up: compilation and first-use checks may read back
    torch.cuda.synchronize()
    if _host_split_backends():
        pytest.skip(f"{recipe}: some op runs on {_host_split_backends()}, which read m_splits on the host")
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert gg.dispatch_stats()["selected"], "nothing was dispatched"
