"""torch.compile: the grouped_gemm:: custom ops pass opcheck; a MoE MLP on GroupedLinear
compiles with fullgraph=True (no graph break) and matches eager."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import grouped_gemm as gg
from grouped_gemm import ops as gg_ops
from grouped_gemm.testing import rel_error

ops = torch.ops.grouped_gemm


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _opcheck_cases(gen: torch.Generator) -> list[tuple]:
    g, m, n, k, splits = 3, 14, 5, 6, [4, 0, 10]
    x = torch.randn(m, k, generator=gen, requires_grad=True)
    w = torch.randn(g, n, k, generator=gen, requires_grad=True)
    b = torch.randn(g, n, generator=gen, requires_grad=True)
    dy = torch.randn(m, n, generator=gen, requires_grad=True)
    parts = [p.detach().requires_grad_() for p in w.unbind(0)]
    cases = []
    for s, st in ((splits, None), (None, torch.tensor(splits))):
        cases += [
            (ops.fwd, (x, [w], b, s, st, "fp32", None)),
            (ops.fwd, (x, parts, None, s, st, "fp32", None)),
            (ops.fwd, (x, [w], b, s, st, "fp32", [torch.zeros(g, n, k)])),
            (ops.dgrad, (dy, [w], s, st, "fp32")),
            (ops.wgrad, (dy, x, s, st, "fp32")),
            (ops.wgrad_accumulate_, (dy.detach(), x.detach(), s, st, "fp32", [torch.randn(g, n, k, generator=gen)])),
            (ops.bias_grad, (dy.detach(), s, st)),
        ]
    return cases


def test_opcheck_every_op(gen):
    for op, args in _opcheck_cases(gen):
        torch.library.opcheck(op, args)


class MoEMLP(torch.nn.Module):
    """Router, top-k, permute, GroupedLinear gate-up, SwiGLU, GroupedLinear down, unpermute.

    Everything is static-shape tensor code: the per-expert counts come from ``index_add_``
    (a device tensor), so a compiled graph is reused whatever the routing.
    """

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, recipe: str, **kwargs) -> None:
        super().__init__()
        dtype = getattr(torch, gg.get_recipe(recipe).plain_dtype or "bfloat16")
        self.router = torch.nn.Linear(hidden, experts, bias=False, dtype=dtype)
        self.gate_up = gg.GroupedLinear(experts, hidden, 2 * ffn, recipe=recipe, **kwargs)
        self.down = gg.GroupedLinear(experts, ffn, hidden, recipe=recipe)
        self.experts, self.top_k = experts, top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).float().softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.experts, dtype=torch.int64, device=x.device)
        counts.index_add_(0, flat, torch.ones_like(flat))
        token = order // self.top_k
        gate, up = self.gate_up(x[token], counts).chunk(2, dim=-1)
        y = self.down(F.silu(gate) * up, counts)
        y = y * weights.flatten()[order, None].to(y.dtype)
        return torch.zeros_like(x).index_add_(0, token, y)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(
    model: torch.nn.Module, x: torch.Tensor, run: torch.nn.Module | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """One forward/backward of ``run`` (default: ``model``); gradients read from ``model``."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = (model if run is None else run)(x)
    y.float().square().mean().backward()
    return y.detach(), x.grad, _grads(model)


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_moe_fullgraph_matches_eager_and_reuses_one_graph(recipe, gen):
    torch.manual_seed(0)
    model = MoEMLP(32, 24, 8, 2, recipe)
    dtype = model.router.weight.dtype
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for step in range(3):
        x = torch.randn(40, 32, generator=gen).to(dtype)
        y, dx, grads = _step(model, x)
        yc, dxc, grads_c = _step(model, x, compiled)
        # Same kernels on the same data in the same order: equal up to fp32 summation order.
        assert rel_error(yc, y) < 1e-6, step
        assert rel_error(dxc, dx) < 1e-6
        assert grads.keys() == grads_c.keys() and len(grads) == 5
        for name in grads:
            assert rel_error(grads_c[name], grads[name]) < 1e-6, name
    assert counters["stats"]["unique_graphs"] == 1


def test_mx_recipe_compiles_and_matches_eager(gen):
    """Compiled and eager both quantize the weights inside each call: the same numbers."""
    torch.manual_seed(0)
    model = MoEMLP(64, 32, 4, 2, "mxfp8")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(40, 64, generator=gen).bfloat16()
    with gg.use_backends("reference", strict=True):
        y, dx, grads = _step(model, x)
        yc, dxc, grads_c = _step(model, x, compiled)
    assert rel_error(yc, y) < 1e-6 and rel_error(dxc, dx) < 1e-6
    for name in grads:
        assert rel_error(grads_c[name], grads[name]) < 1e-6, name


@pytest.mark.slow
def test_moe_fullgraph_with_inductor(gen):
    torch.manual_seed(0)
    model = MoEMLP(32, 24, 8, 2, "fp32")
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(40, 32, generator=gen)
    y, dx, grads = _step(model, x)
    yc, dxc, grads_c = _step(model, x, compiled)
    # Inductor may fuse and reorder the pointwise / reduction work around the GEMMs.
    assert rel_error(yc, y) < 1e-5
    assert rel_error(dxc, dx) < 1e-5
    for name in grads:
        assert rel_error(grads_c[name], grads[name]) < 1e-5, name


def test_fused_wgrad_accumulation_compiles(gen):
    torch.manual_seed(0)
    model = MoEMLP(32, 24, 8, 2, "fp32", fuse_wgrad_accumulation=True)
    model.gate_up.weight.main_grad = torch.zeros_like(model.gate_up.weight)
    x = torch.randn(40, 32, generator=gen)
    _step(model, x)
    eager = model.gate_up.weight.main_grad.clone()
    assert eager.abs().sum() > 0
    model.gate_up.weight.main_grad.zero_()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    _, _, grads = _step(model, x, compiled)
    assert "gate_up.weight" not in grads
    assert rel_error(model.gate_up.weight.main_grad, eager) < 1e-6


def test_functional_calls_run_outside_the_graph(gen):
    """gg.grouped_gemm / _dgrad / _wgrad under torch.compile: one graph break at the call,
    the eager result, no trace of the dispatcher (whose caches and host reads Dynamo warned
    about); fullgraph=True names the ops to use instead."""
    x, w = torch.randn(16, 32, generator=gen), torch.randn(3, 24, 32, generator=gen)
    dy, splits = torch.randn(16, 24, generator=gen), torch.tensor([7, 0, 9])
    calls = {
        "fwd": lambda: gg.grouped_gemm(x, w, splits),
        "dgrad": lambda: gg.grouped_gemm_dgrad(dy, w, splits),
        "wgrad": lambda: gg.grouped_gemm_wgrad(dy, x, splits),
    }
    for op, call in calls.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # Dynamo's warnings about tracing library internals
            got = torch.compile(call, backend="eager")()
        assert torch.equal(got, call()), op
        torch._dynamo.reset()  # the frame compiled above would be reused as it is
        with pytest.raises(Exception, match=r"torch\.ops\.grouped_gemm"):
            torch.compile(call, backend="eager", fullgraph=True)()


def test_an_fp32_bias_of_a_bf16_layer_gets_the_same_gradient_compiled(gen):
    """The compiled bias-gradient op returned dy's dtype, so the fp32 bias of a bf16 layer
    got its gradient rounded to bf16 (eager sums in fp32 and keeps it)."""
    layer = gg.GroupedLinear(3, 32, 16, dtype=torch.bfloat16)
    layer.bias = torch.nn.Parameter(layer.bias.detach().float())
    x = torch.randn(40, 32, generator=gen).bfloat16()
    dy = torch.randn(40, 16, generator=gen).bfloat16()
    splits = torch.tensor([10, 0, 30])
    grads = []
    for run in (layer, torch.compile(layer, fullgraph=True, backend="aot_eager")):
        run(x, splits).backward(dy)
        grads.append(layer.bias.grad.clone())
        layer.zero_grad()
    want = torch.stack([d.double().sum(0) for d in dy.split([10, 0, 30])])
    assert grads[0].dtype == grads[1].dtype == torch.float32
    assert torch.equal(grads[1], grads[0])
    assert torch.allclose(grads[0].double(), want, rtol=1e-6, atol=1e-6)


def test_host_list_splits_compile_and_match_eager(gen):
    """A host list is legal under fullgraph; Dynamo guards on its values (see docs/module.md)."""
    torch.manual_seed(0)
    layer = gg.GroupedLinear(3, 16, 8, recipe="fp32")

    def f(x, splits):
        return layer(x, splits)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for splits in ([4, 0, 6], [1, 8, 1], [10, 0, 0]):
        x = torch.randn(10, 16, generator=gen)
        assert rel_error(compiled(x, splits), f(x, splits)) < 1e-6


def test_out_buffer_under_compile(gen):
    layer = gg.GroupedLinear(3, 16, 8, recipe="fp32")
    x = torch.randn(10, 16, generator=gen)
    out = torch.full((10, 8), float("nan"))
    compiled = torch.compile(lambda x, out: layer(x, [4, 0, 6], out=out), fullgraph=True, backend="aot_eager")
    compiled(x, out)
    assert rel_error(out, layer(x, [4, 0, 6])) < 1e-6


@pytest.mark.parametrize("trans_b", [False, True])
def test_gmm_compiles(trans_b, gen):
    a = torch.randn(20, 12, generator=gen, requires_grad=True)
    b = torch.randn((4, 9, 12) if trans_b else (4, 12, 9), generator=gen, requires_grad=True)
    sizes = torch.tensor([6, 0, 11, 3])
    compiled = torch.compile(gg_ops.gmm, fullgraph=True, backend="aot_eager")
    out = compiled(a, b, sizes, trans_b)
    out.sum().backward()
    da, db = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    eager = gg_ops.gmm(a, b, sizes, trans_b)
    eager.sum().backward()
    assert rel_error(out, eager) < 1e-6
    assert rel_error(da, a.grad) < 1e-6 and rel_error(db, b.grad) < 1e-6


@pytest.mark.gpu
def test_gpu_moe_fullgraph_inductor_matches_eager():
    torch.manual_seed(0)
    model = MoEMLP(1024, 768, 32, 4, "bf16").cuda()
    compiled = torch.compile(model, fullgraph=True)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        x = torch.randn(2048, 1024, generator=gen).bfloat16().cuda()
        y, dx, grads = _step(model, x)
        yc, dxc, grads_c = _step(model, x, compiled)
        # bf16 pointwise work (SiLU, gating) may be fused by Inductor in fp32: a few bf16 ulps.
        assert rel_error(yc, y) < 2e-2
        assert rel_error(dxc, dx) < 2e-2
        for name in grads:
            assert rel_error(grads_c[name], grads[name]) < 2e-2, name
    print("\nGPU compiled MoE backends:", gg.dispatch_stats()["selected"])
    assert counters["stats"]["unique_graphs"] == 1
