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
    """Output, dx and dW (None when the weight is frozen) of one eager step, through
    ``autograd.grad`` so that no ``.grad`` is touched."""
    xe = x.detach().clone().requires_grad_()
    y = layer(xe, splits)
    wanted = (xe, layer.weight) if layer.weight.requires_grad else (xe,)
    grads = torch.autograd.grad(y, wanted, dy)
    return y.detach(), grads[0], grads[1] if len(grads) > 1 else None


def _skip_without_capturable_backends(recipe: str, err: gg.BackendUnavailableError) -> None:
    pytest.skip(f"{recipe}: no capturable backend for one of its ops on this GPU yet: {err}")


def _host_split_backends() -> list[str]:
    """Backends the calls so far went to that read ``m_splits`` on the host (a sync)."""
    host = {b.name for b in gg.list_backends() if b.spec.host_splits}
    return sorted(host & set(gg.dispatch_stats()["selected"]))


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", MX_RECIPES)
@pytest.mark.parametrize("wgrad", [True, False], ids=["fwd_dgrad_wgrad", "fwd_dgrad"])
def test_gpu_graph_replay_after_weight_update_equals_eager(recipe, wgrad):
    """Capture fwd + bwd, update the weights in place outside the graph, replay: equal to
    eager bit for bit. ``fwd_dgrad`` captures without wgrad (weights not trained), which
    covers both weight quantizations on recipes whose wgrad has no capturable backend."""
    layer = _layer(recipe, seed=1)
    layer.weight.requires_grad_(wgrad)
    x, dy, splits = _inputs(seed=2)
    static_x = x.clone().requires_grad_()
    # Warm up on a side stream (Triton compiles here, not inside the capture).
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
        if wgrad:
            assert torch.equal(layer.weight.grad, dw), (recipe, step)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", MX_RECIPES)
@pytest.mark.parametrize("wgrad", [True, False], ids=["fwd_dgrad_wgrad", "fwd_dgrad"])
def test_gpu_mx_step_does_not_sync(recipe, wgrad):
    """fwd + bwd + an in-place weight update (SGD when the weights train) with device splits,
    fresh weights every step, syncs forbidden."""
    layer = _layer(recipe, seed=3)
    layer.weight.requires_grad_(wgrad)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.01)
    x, dy, splits = _inputs(seed=4)
    x.requires_grad_()
    delta = torch.full_like(layer.weight, 1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        layer(x, splits).backward(dy)
        if wgrad:
            optimizer.step()
        else:
            with torch.no_grad():
                layer.weight.add_(delta)

    step()  # warm-up: compilation and first-use checks may read back
    torch.cuda.synchronize()
    if _host_split_backends():
        pytest.skip(f"{recipe}: some op runs on {_host_split_backends()}, which read m_splits on the host")
    gg.reset_dispatch_stats()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert sum(gg.dispatch_stats()["selected"].values()) == (3 if wgrad else 2)


@pytest.mark.gpu
@pytest.mark.parametrize("api", ["grouped_linear", "ops.gmm"])
@pytest.mark.parametrize("recipe", ["mxfp4", "a16w4"])
def test_gpu_functional_apis_requantize_on_replay(api, recipe):
    """``gg.grouped_linear`` and ``gg.ops.gmm`` with an MX recipe: fwd + dgrad captured,
    the weight tensor updated in place, replay equals eager bit for bit."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(G, N, K, generator=gen).bfloat16().cuda()
    x, dy, splits = _inputs(seed=6)
    static_x = x.clone().requires_grad_()

    def run(inp: torch.Tensor) -> torch.Tensor:
        if api == "grouped_linear":
            return gg.grouped_linear(inp, w, splits, recipe=recipe)
        return gg.ops.gmm(inp, w, splits, trans_b=True, recipe=recipe)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run(static_x).backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = run(static_x)
        static_y.backward(dy)
    for step in range(2):
        w.add_(torch.randn_like(w), alpha=0.1 * (step + 1))
        graph.replay()
        xe = static_x.detach().clone().requires_grad_()
        y = run(xe)
        (dx,) = torch.autograd.grad(y, (xe,), dy)
        assert torch.equal(static_y, y.detach()) and torch.equal(static_x.grad, dx), (api, recipe, step)
