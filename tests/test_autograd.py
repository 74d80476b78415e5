"""Autograd of grouped_linear and the grouped_gemm:: custom ops against float64 references."""

from __future__ import annotations

import threading

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm.backends.reference import ReferenceBackend
from grouped_gemm.linear import bias_grad
from grouped_gemm.recipe_codec import recipe_from_key, recipe_key
from grouped_gemm.testing import poison, random_splits, ref_wgrad, rel_error, sqnr_db

ops = torch.ops.grouped_gemm

# (G, M, N, K, splits or None for random): empty groups, all empty, G=1, skewed, unaligned.
CASES = {
    "random": (4, 40, 12, 20, None),
    "empty_groups": (5, 33, 8, 16, [0, 20, 0, 13, 0]),
    "all_empty": (3, 0, 8, 16, [0, 0, 0]),
    "one_group": (1, 17, 6, 10, [17]),
    "skewed": (8, 100, 16, 24, gg.skewed_splits(8, 100)),
    "unaligned": (3, 29, 13, 7, [11, 1, 17]),
}


def _case(name: str, gen: torch.Generator) -> tuple[int, int, int, int, list[int]]:
    g, m, n, k, splits = CASES[name]
    return g, m, n, k, splits if splits is not None else random_splits(g, m, empty=1, generator=gen)


def ref_linear(x: torch.Tensor, ws: list[torch.Tensor], bias: torch.Tensor | None, splits: list[int]) -> torch.Tensor:
    """The layer as G separate float64 matmuls, differentiable with plain autograd."""
    rows, start = [], 0
    for g, r in enumerate(splits):
        y = x[start : start + r] @ ws[g].T
        rows.append(y + bias[g] if bias is not None else y)
        start += r
    return torch.cat(rows) if rows else x.new_zeros(0, ws[0].shape[0])


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().double().requires_grad_()


def _inputs(g, m, n, k, gen, dtype=torch.float32, bias=True):
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(g, n, k, generator=gen).to(dtype)
    b = torch.randn(g, n, generator=gen).to(dtype) if bias else None
    dy = torch.randn(m, n, generator=gen).to(dtype)
    return x, w, b, dy


def _reference_grads(x, w, b, dy, splits):
    x64, w64 = _f64(x), _f64(w)
    b64 = _f64(b) if b is not None else None
    y64 = ref_linear(x64, list(w64.unbind(0)), b64, splits)
    y64.backward(dy.double())
    return y64.detach(), x64.grad, w64.grad, (b64.grad if b is not None else None)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("bias", [True, False])
def test_fp32_grads_match_float64(case, bias, gen):
    g, m, n, k, splits = _case(case, gen)
    x, w, b, dy = _inputs(g, m, n, k, gen, bias=bias)
    xl, wl = _leaf(x), _leaf(w)
    bl = _leaf(b) if bias else None
    y = gg.grouped_linear(xl, wl, splits, bl)
    y.backward(dy)
    y64, dx64, dw64, db64 = _reference_grads(x, w, b, dy, splits)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert rel_error(y, y64) < 1e-5
    assert rel_error(xl.grad, dx64) < 1e-5
    assert rel_error(wl.grad, dw64) < 1e-5
    empty = [i for i, r in enumerate(splits) if r == 0]
    assert torch.equal(wl.grad[empty], torch.zeros_like(wl.grad[empty]))
    if bias:
        assert rel_error(bl.grad, db64) < 1e-5
        assert torch.equal(bl.grad[empty], torch.zeros_like(bl.grad[empty]))


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_half_precision_grads_match_float64(dtype, tol, gen):
    g, m, n, k, splits = _case("skewed", gen)
    x, w, b, dy = _inputs(g, m, n, k, gen, dtype=dtype)
    xl, wl, bl = _leaf(x), _leaf(w), _leaf(b)
    y = gg.grouped_linear(xl, wl, splits, bl)
    y.backward(dy)
    y64, dx64, dw64, db64 = _reference_grads(x, w, b, dy, splits)
    assert y.dtype == xl.grad.dtype == wl.grad.dtype == bl.grad.dtype == dtype
    for got, want in ((y, y64), (xl.grad, dx64), (wl.grad, dw64), (bl.grad, db64)):
        assert rel_error(got, want) < tol


def test_weight_list_matches_stacked(gen):
    g, m, n, k, splits = _case("empty_groups", gen)
    x, w, b, dy = _inputs(g, m, n, k, gen)
    parts = [_leaf(p) for p in w.unbind(0)]
    xl = _leaf(x)
    gg.grouped_linear(xl, parts, splits, b).backward(dy)
    _, dx64, dw64, _ = _reference_grads(x, w, b, dy, splits)
    assert rel_error(xl.grad, dx64) < 1e-5
    assert rel_error(torch.stack([p.grad for p in parts]), dw64) < 1e-5


def test_finite_differences_fp32(gen):
    """Directional derivatives by central differences agree with the analytic gradients.

    The layer is linear in each argument, so central differences have no truncation
    error; what remains is fp32 rounding of f (about 1e-7 relative), divided by 2*eps.
    """
    g, m, n, k, splits = 3, 24, 10, 12, [9, 0, 15]
    x, w, b, r = _inputs(g, m, n, k, gen)
    xl, wl, bl = _leaf(x), _leaf(w), _leaf(b)
    (gg.grouped_linear(xl, wl, splits, bl) * r).sum().backward()
    eps = 1e-2

    def f(xx, ww, bb):
        return float((gg.grouped_linear(xx, ww, splits, bb).double() * r.double()).sum())

    for name, grad in (("x", xl.grad), ("w", wl.grad), ("b", bl.grad)):
        v = torch.randn(grad.shape, generator=gen)
        args = {"x": x, "w": w, "b": b}
        plus = dict(args, **{name: args[name] + eps * v})
        minus = dict(args, **{name: args[name] - eps * v})
        numeric = (f(plus["x"], plus["w"], plus["b"]) - f(minus["x"], minus["w"], minus["b"])) / (2 * eps)
        analytic = float((grad.double() * v.double()).sum())
        assert abs(numeric - analytic) <= 1e-3 * max(1.0, abs(analytic)), name


class SpyBackend(ReferenceBackend):
    """The reference backend under another name and top priority, recording each problem."""

    spec = ReferenceBackend.spec.model_copy(update={"name": "spy_autograd", "priority": 10_000})

    def __init__(self) -> None:
        self.problems: list[gg.Problem] = []
        self.b_ptrs: list[int] = []

    def run(self, problem, inputs):
        self.problems.append(problem)
        b = inputs.b[0] if isinstance(inputs.b, list) else inputs.b
        self.b_ptrs.append(b.data.data_ptr() if isinstance(b, gg.MXTensor) else b.data_ptr())
        return super().run(problem, inputs)


@pytest.fixture
def spy(register):
    return register(SpyBackend())


def test_each_op_is_dispatched_for_its_own_problem(spy, gen):
    g, m, n, k, splits = 4, 40, 12, 20, [10, 0, 25, 5]
    x, w, b, dy = _inputs(g, m, n, k, gen, dtype=torch.bfloat16)
    xl, wl = _leaf(x), _leaf(w)
    gg.grouped_linear(xl, wl, splits, b).backward(dy)
    seen = [(p.op, p.groups, p.m, p.n, p.k, p.recipe, p.a_format) for p in spy.problems]
    assert seen == [
        ("fwd", g, m, n, k, "bf16", "bfloat16"),
        ("dgrad", g, m, n, k, "bf16", "bfloat16"),
        ("wgrad", g, m, n, k, "bf16", "bfloat16"),
    ]
    assert gg.dispatch_stats()["selected"] == {"spy_autograd": 3}


def test_backward_skips_gradients_nobody_needs(spy, gen):
    x, w, _, dy = _inputs(2, 10, 4, 6, gen)
    gg.grouped_linear(_leaf(x), w, [4, 6]).backward(dy)
    assert [p.op for p in spy.problems] == ["fwd", "dgrad"]
    spy.problems.clear()
    gg.grouped_linear(x, _leaf(w), [4, 6]).backward(dy)
    assert [p.op for p in spy.problems] == ["fwd", "wgrad"]


def test_device_splits_tensor_matches_list(gen):
    g, m, n, k, splits = _case("skewed", gen)
    x, w, b, dy = _inputs(g, m, n, k, gen)
    results = []
    for s in (splits, torch.tensor(splits), torch.tensor(splits, dtype=torch.int32)):
        xl, wl, bl = _leaf(x), _leaf(w), _leaf(b)
        y = gg.grouped_linear(xl, wl, s, bl)
        y.backward(dy)
        results.append((y, xl.grad, wl.grad, bl.grad))
    for other in results[1:]:
        for a, c in zip(results[0], other, strict=True):
            assert torch.equal(a, c)


def test_out_buffer_is_written_and_differentiable(gen):
    g, m, n, k, splits = _case("empty_groups", gen)
    x, w, b, dy = _inputs(g, m, n, k, gen)
    out = poison(torch.empty(m, n))
    xl, wl, bl = _leaf(x), _leaf(w), _leaf(b)
    y = gg.grouped_linear(xl, wl, splits, bl, out=out)
    assert y.data_ptr() == out.data_ptr()
    y.backward(dy)
    y64, dx64, dw64, db64 = _reference_grads(x, w, b, dy, splits)
    assert rel_error(out, y64) < 1e-5
    assert rel_error(xl.grad, dx64) < 1e-5 and rel_error(wl.grad, dw64) < 1e-5 and rel_error(bl.grad, db64) < 1e-5


def test_out_that_requires_grad_is_rejected(gen):
    x, w, _, _ = _inputs(2, 6, 4, 3, gen)
    with pytest.raises(gg.InvalidArgumentError, match="out"):
        gg.grouped_linear(x, w, [3, 3], out=torch.zeros(6, 4, requires_grad=True))


@pytest.mark.parametrize("separate", [False, True])
def test_fused_wgrad_accumulation_adds_into_main_grad(separate, gen):
    g, m, n, k, splits = _case("empty_groups", gen)
    x, w, _, dy = _inputs(g, m, n, k, gen, dtype=torch.bfloat16)
    params = [_leaf(p) for p in w.unbind(0)] if separate else [_leaf(w)]
    for p in params:
        p.main_grad = torch.randn(p.shape, generator=gen)
    start = torch.stack([p.main_grad for p in params]).reshape(g, n, k).clone()
    weight = params if separate else params[0]
    for _ in range(2):
        gg.grouped_linear(x, weight, splits, fuse_wgrad_accumulation=True).backward(dy)
    got = torch.stack([p.main_grad for p in params]).reshape(g, n, k)
    assert got.dtype == torch.float32
    assert rel_error(got - start, 2 * ref_wgrad(dy, x, splits)) < 1e-5
    empty = [i for i, r in enumerate(splits) if r == 0]
    assert torch.equal(got[empty], start[empty])
    assert all(p.grad is None for p in params)


def test_fused_wgrad_gives_megatron_placeholder(gen):
    x, w, _, dy = _inputs(2, 10, 4, 6, gen)
    wl = _leaf(w)
    wl.main_grad = torch.zeros_like(w)
    wl.grad_added_to_main_grad = False
    wl.zero_out_wgrad = True
    gg.grouped_linear(x, wl, [3, 7], fuse_wgrad_accumulation=True).backward(dy)
    assert wl.grad_added_to_main_grad is True
    assert wl.grad is not None and wl.grad.shape == w.shape and not wl.grad.any()
    assert rel_error(wl.main_grad, ref_wgrad(dy, x, [3, 7])) < 1e-5


@pytest.mark.parametrize(
    "main_grad,match",
    [(None, "main_grad"), (torch.zeros(2, 4), "shape")],
)
def test_fused_wgrad_needs_a_main_grad_of_the_weight_shape(main_grad, match, gen):
    x, w, _, _ = _inputs(2, 10, 4, 6, gen)
    wl = _leaf(w)
    if main_grad is not None:
        wl.main_grad = main_grad
    with pytest.raises(gg.InvalidArgumentError, match=match):
        gg.grouped_linear(x, wl, [3, 7], fuse_wgrad_accumulation=True)


def test_bad_splits_are_named(gen):
    x, w, _, _ = _inputs(2, 10, 4, 6, gen)
    with pytest.raises(gg.InvalidTypeError, match="m_splits"):
        gg.grouped_linear(x, w, "3,7")
    with pytest.raises(gg.SplitsError, match="m_splits"):
        gg.grouped_linear(x, w, [3, 6])


def test_bias_grad_sums_in_fp32():
    """A bf16 running sum of 4096 ones-ish values would stall near 256."""
    dy = torch.full((4096, 3), 1.0, dtype=torch.bfloat16)
    got = bias_grad(dy, [4000, 0, 96])
    assert got.dtype == torch.bfloat16
    assert got[:, 0].tolist() == [4000.0, 0.0, 96.0]


def test_recipe_key_round_trips():
    custom = gg.get_recipe("mxfp8").model_copy(update={"scale_rule": "floor", "grad_format": "e5m2"})
    assert recipe_key(gg.get_recipe("bf16")) == "bf16"
    assert recipe_key(custom) == "mxfp8;scale_rule=floor;grad_format=e5m2"
    assert recipe_from_key(recipe_key(custom)) == custom
    no_grad_format = gg.get_recipe("mxfp8").model_copy(update={"grad_format": None})
    assert recipe_from_key(recipe_key(no_grad_format)) == no_grad_format


@pytest.mark.parametrize(
    "recipe,error",
    [
        ("int8", gg.UnknownRecipeError),
        ("mxfp8;scale_rule=floor", gg.UnknownRecipeError),
        (gg.get_recipe("mxfp8").model_copy(update={"act_format": "e2m1"}), gg.UnknownRecipeError),
        (3, gg.UnknownRecipeError),
    ],
)
def test_bad_recipes_are_named(recipe, error, gen):
    x, w, _, _ = _inputs(2, 10, 4, 6, gen)
    with pytest.raises(error, match="recipe"):
        gg.grouped_linear(x, w, [3, 7], recipe=recipe)


def test_default_recipe_needs_a_float_input():
    with pytest.raises(gg.InvalidTypeError, match="x"):
        gg.grouped_linear(torch.zeros(4, 6, dtype=torch.int32), torch.zeros(2, 4, 6), [2, 2])


@pytest.mark.parametrize("backward_thread", ["caller", "other"])
def test_backward_uses_the_dispatch_scope_of_the_forward(backward_thread, spy, gen):
    """On CUDA, autograd runs backward nodes on its own threads, which do not see the
    caller's context variables; the eager route carries the forward's context there."""
    x, w, _, dy = _inputs(2, 10, 4, 6, gen)
    with gg.use_backends("reference"):
        y = gg.grouped_linear(_leaf(x), _leaf(w), [3, 7])
    if backward_thread == "caller":
        y.backward(dy)
    else:
        worker = threading.Thread(target=y.backward, args=(dy,))
        worker.start()
        worker.join()
    assert spy.problems == []
    assert gg.dispatch_stats()["selected"] == {"reference": 3}


# ------------------------------------------------------------------ the custom ops


@pytest.mark.parametrize("splits_as", ["list", "tensor"])
def test_custom_ops_autograd_matches_float64(splits_as, gen):
    g, m, n, k, splits = _case("unaligned", gen)
    x, w, b, dy = _inputs(g, m, n, k, gen)
    s, st = (splits, None) if splits_as == "list" else (None, torch.tensor(splits))
    xl, wl, bl = _leaf(x), _leaf(w), _leaf(b)
    y = ops.fwd(xl, [wl], bl, s, st, "fp32", None)
    y.backward(dy)
    y64, dx64, dw64, db64 = _reference_grads(x, w, b, dy, splits)
    assert rel_error(y, y64) < 1e-5
    for got, want in ((xl.grad, dx64), (wl.grad, dw64), (bl.grad, db64)):
        assert rel_error(got, want) < 1e-5


def test_custom_ops_double_backward(gen):
    """d/dw of <dgrad(r, w), v> is wgrad(r, v): exercises dgrad's registered autograd."""
    g, m, n, k, splits = _case("empty_groups", gen)
    x, w, _, r = _inputs(g, m, n, k, gen, bias=False)
    v = torch.randn(m, k, generator=gen)
    xl, wl = _leaf(x), _leaf(w)
    y = ops.fwd(xl, [wl], None, splits, None, "fp32", None)
    (dx,) = torch.autograd.grad((y * r).sum(), xl, create_graph=True)
    (dw,) = torch.autograd.grad((dx * v).sum(), wl)
    x64, w64 = _f64(x), _f64(w)
    y64 = ref_linear(x64, list(w64.unbind(0)), None, splits)
    (dx64,) = torch.autograd.grad((y64 * r.double()).sum(), x64, create_graph=True)
    (dw64,) = torch.autograd.grad((dx64 * v.double()).sum(), w64)
    assert rel_error(dx, dx64) < 1e-5
    assert rel_error(dw, dw64) < 1e-5


def test_wgrad_op_autograd(gen):
    g, m, n, k, splits = _case("random", gen)
    _, _, _, dy = _inputs(g, m, n, k, gen)
    x = torch.randn(m, k, generator=gen)
    t = torch.randn(g, n, k, generator=gen)
    dyl, xl = _leaf(dy), _leaf(x)
    (ops.wgrad(dyl, xl, splits, None, "fp32") * t).sum().backward()
    dy64, x64 = _f64(dy), _f64(x)
    starts = [sum(splits[:i]) for i in range(g)]
    dw64 = torch.stack([dy64[s : s + r].T @ x64[s : s + r] for s, r in zip(starts, splits, strict=True)])
    (dw64 * t.double()).sum().backward()
    assert rel_error(dyl.grad, dy64.grad) < 1e-5
    assert rel_error(xl.grad, x64.grad) < 1e-5


# ------------------------------------------------------------------ MX recipes

# SQNR (dB) of GroupedLinear's output, dgrad and wgrad on the reference backend against
# float64 autograd of the same bf16 inputs, random normal data, G=8, M=1024, N=256, K=512,
# skewed splits. Kernel backends are held to the reference by their own tests.
# Measured on the reference backend (min over 5 seeds): mxfp8 28.45 / 28.46 / 28.46,
# mxfp4 15.75 / 15.76 / 15.75, a8w4 18.51 / 18.53 / 28.46, a16w4 18.73 / 18.75 / 55.58.
# mxfp8's floors are the project's targets; the others sit below what was measured.
MX_FLOORS = {
    "mxfp8": (25.0, 23.0, 22.0),
    "mxfp4": (15.0, 15.0, 15.0),
    "a8w4": (17.5, 17.5, 27.0),
    "a16w4": (17.5, 17.5, 50.0),
}


@pytest.mark.parametrize("recipe", sorted(MX_FLOORS))
def test_mx_recipes_meet_their_sqnr_floors(recipe):
    gen = torch.Generator().manual_seed(7)
    g, m, n, k = 8, 1024, 256, 512
    splits = gg.skewed_splits(g, m, seed=7)
    splits[0], splits[3] = splits[0] + splits[3], 0
    layer = gg.GroupedLinear(g, k, n, bias=False, recipe=recipe)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(g, n, k, generator=gen))
    x = torch.randn(m, k, generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(m, n, generator=gen).bfloat16()
    with gg.use_backends("reference", strict=True):  # backward runs in the forward's scope
        y = layer(x, splits)
    y.backward(dy)
    assert gg.dispatch_stats()["selected"] == {"reference": 3}
    y64, dx64, dw64, _ = _reference_grads(x, layer.weight, None, dy, splits)
    floors = MX_FLOORS[recipe]
    got = (sqnr_db(y, y64), sqnr_db(x.grad, dx64), sqnr_db(layer.weight.grad, dw64))
    assert all(s >= f for s, f in zip(got, floors, strict=True)), (recipe, got, floors)
    assert not layer.weight.grad[3].any()


def test_mx_backward_uses_the_grad_format_and_quantizes_weights_per_call(spy):
    """dgrad and wgrad are dispatched with the recipe's gradient format; fwd and dgrad get
    the master weights (the backend quantizes them inside the call), unless the layer's
    weights were explicitly frozen (then the frozen copies, blocked along K and along N)."""
    recipe = gg.get_recipe("mxfp8").model_copy(update={"grad_format": "e5m2"})
    layer = gg.GroupedLinear(2, 64, 32, recipe=recipe)
    x = torch.randn(64, 64).bfloat16().requires_grad_()
    layer(x, [32, 32]).backward(torch.randn(64, 32).bfloat16())
    assert [(p.op, p.recipe, p.grad_format, p.b_format) for p in spy.problems] == [
        ("fwd", "mxfp8", "e5m2", "bfloat16"),
        ("dgrad", "mxfp8", "e5m2", "bfloat16"),
        ("wgrad", "mxfp8", "e5m2", "bfloat16"),
    ]
    spy.problems.clear()
    layer.requires_grad_(False)
    layer.freeze_quantized_weights(backward=True)
    layer(x, [32, 32]).backward(torch.randn(64, 32).bfloat16())
    assert [(p.op, p.b_format) for p in spy.problems] == [("fwd", "mx_e4m3"), ("dgrad", "mx_e4m3")]


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", sorted(MX_FLOORS))
def test_gpu_mx_module_meets_the_floors(recipe):
    """Qwen3-30B-A3B gate-up on 32 experts (K=2048, N=1536), skewed splits, on whatever
    backends the dispatcher picks on this GPU, with MX weights quantized inside each call."""
    gen = torch.Generator().manual_seed(11)
    g, m, n, k = 32, 8192, 1536, 2048
    splits = gg.skewed_splits(g, m, seed=11)
    layer = gg.GroupedLinear(g, k, n, bias=False, recipe=recipe, device="cuda")
    with torch.no_grad():
        layer.weight.copy_(torch.randn(g, n, k, generator=gen))
    x = torch.randn(m, k, generator=gen).bfloat16().cuda().requires_grad_()
    dy = torch.randn(m, n, generator=gen).bfloat16().cuda()
    y = layer(x, torch.tensor(splits, device="cuda"))
    y.backward(dy)
    y64, dx64, dw64, _ = _reference_grads(x, layer.weight, None, dy, splits)
    got = (sqnr_db(y, y64), sqnr_db(x.grad, dx64), sqnr_db(layer.weight.grad, dw64))
    print(
        f"\nGPU {recipe} SQNR out/dgrad/wgrad {got[0]:.2f}/{got[1]:.2f}/{got[2]:.2f} dB",
        gg.dispatch_stats()["selected"],
    )
    assert all(s >= f for s, f in zip(got, MX_FLOORS[recipe], strict=True)), (recipe, got)
