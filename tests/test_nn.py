"""GroupedLinear: parameters, init, checkpoint layouts, training features, errors."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm.testing import poison, ref_fwd, ref_wgrad, rel_error, sqnr_db


def expert_linears(layer: gg.GroupedLinear) -> list[torch.nn.Linear]:
    """G float64 nn.Linear copies of the layer's experts: the module's definition."""
    linears = []
    for g, w in enumerate(layer.weights if layer.separate_weights else layer.weight.unbind(0)):
        lin = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.use_bias, dtype=torch.float64)
        with torch.no_grad():
            lin.weight.copy_(w)
            if layer.use_bias:
                lin.bias.copy_(layer.biases[g] if layer.separate_weights else layer.bias[g])
        linears.append(lin)
    return linears


def run_experts(linears: list[torch.nn.Linear], x: torch.Tensor, splits: list[int]) -> torch.Tensor:
    parts = torch.split(x, splits)
    return torch.cat([lin(p) for lin, p in zip(linears, parts, strict=True)])


def test_parameters_stacked():
    layer = gg.GroupedLinear(4, 16, 8)
    assert dict((n, tuple(p.shape)) for n, p in layer.named_parameters()) == {"weight": (4, 8, 16), "bias": (4, 8)}
    assert layer.weight.dtype == torch.bfloat16
    assert gg.GroupedLinear(4, 16, 8, bias=False).bias is None


def test_parameters_separate_use_per_expert_names():
    layer = gg.GroupedLinear(3, 16, 8, separate_weights=True)
    names = [n for n, _ in layer.named_parameters()]
    assert names == ["weight0", "bias0", "weight1", "bias1", "weight2", "bias2"]
    assert all(p.shape == (8, 16) for p in layer.weights)
    assert all(p.shape == (8,) for p in layer.biases)


@pytest.mark.parametrize(
    "recipe,dtype,expected",
    [
        ("bf16", None, torch.bfloat16),
        ("fp16", None, torch.float16),
        ("fp32", torch.float32, torch.float32),
        ("mxfp8", None, torch.bfloat16),
        ("mxfp8", torch.float32, torch.float32),
    ],
)
def test_parameter_dtype_follows_recipe(recipe, dtype, expected):
    assert gg.GroupedLinear(2, 32, 32, recipe=recipe, dtype=dtype).weight.dtype == expected


@pytest.mark.parametrize(
    "dtype,recipe",
    [(None, "bf16"), (torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32")],
)
def test_recipe_follows_dtype_like_nn_linear(dtype, recipe, gen):
    """Without a recipe, ``dtype`` decides it (the plain recipe of that dtype), as for nn.Linear."""
    layer = gg.GroupedLinear(3, 16, 8, dtype=dtype)
    assert layer.recipe.name == recipe and layer.weight.dtype == (dtype or torch.bfloat16)
    splits = [5, 0, 7]
    x = torch.randn(sum(splits), 16, generator=gen).to(layer.weight.dtype)
    y = layer(x, splits)
    assert y.dtype == layer.weight.dtype
    expected = ref_fwd(x, layer.weight.detach(), splits) + torch.repeat_interleave(
        layer.bias.detach().double(), torch.tensor(splits), dim=0
    )
    assert rel_error(y, expected) < {"bf16": 1e-2, "fp16": 2e-3, "fp32": 1e-6}[recipe]


@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("cast", ["bfloat16", "half", "float"])
def test_a_layer_without_recipe_follows_a_cast_of_its_parameters(separate, cast, gen):
    """``model.bfloat16()``, ``.half()``, ``.float()`` (and mixed-precision wrappers, which
    cast the parameters) keep a layer built without a recipe working, computing in the new
    dtype, forward and backward; one built with a recipe keeps it and names the mismatch."""
    layer = gg.GroupedLinear(
        3, 32, 16, dtype=torch.float32 if cast != "float" else torch.bfloat16, separate_weights=separate
    )
    getattr(layer, cast)()
    dtype = layer.weights[0].dtype
    assert layer.recipe.name == {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    assert f"recipe={layer.recipe.name}" in repr(layer)
    splits = [5, 0, 7]
    x = torch.randn(sum(splits), 32, generator=gen).to(dtype).requires_grad_()
    dy = torch.randn(sum(splits), 16, generator=gen).to(dtype)
    y = layer(x, splits)
    y.backward(dy)
    linears = expert_linears(layer)
    x64 = x.detach().double().requires_grad_()
    y64 = run_experts(linears, x64, splits)
    y64.backward(dy.double())
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-6}[dtype]
    assert y.dtype == dtype and rel_error(y, y64) < tol and rel_error(x.grad, x64.grad) < tol
    dw = torch.stack([p.grad for p in layer.weights]) if separate else layer.weight.grad
    assert dw.dtype == dtype and rel_error(dw, torch.stack([lin.weight.grad for lin in linears])) < tol

    fixed = gg.GroupedLinear(3, 32, 16, recipe="fp32", separate_weights=separate)
    getattr(fixed, cast)()
    if fixed.weights[0].dtype != torch.float32:
        assert fixed.recipe.name == "fp32"
        with pytest.raises(gg.DTypeError, match="recipe fp32"):
            fixed(x.detach(), splits)


def test_init_matches_nn_linear_bounds():
    torch.manual_seed(0)
    layer = gg.GroupedLinear(8, 64, 32, recipe="fp32")
    bound = 1 / math.sqrt(64)
    for p in (layer.weight, layer.bias):
        assert p.abs().max() <= bound
        # uniform(-b, b) has std b / sqrt(3); 16k samples put the estimate within a few %.
        assert abs(p.std().item() - bound / math.sqrt(3)) < 0.1 * bound


def test_meta_device_construction():
    layer = gg.GroupedLinear(128, 2048, 1536, device="meta")
    assert layer.weight.is_meta and layer.weight.shape == (128, 1536, 2048)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"num_groups": 0}, gg.InvalidArgumentError, "num_groups"),
        ({"in_features": "8"}, gg.InvalidArgumentError, "in_features"),
        ({"out_features": True}, gg.InvalidArgumentError, "out_features"),
        ({"recipe": "int8"}, gg.UnknownRecipeError, "recipe"),
        ({"recipe": "bf16", "dtype": torch.float32}, gg.DTypeError, "dtype"),
        ({"recipe": "mxfp8", "dtype": torch.float64}, gg.DTypeError, "dtype"),
        ({"dtype": torch.float64}, gg.DTypeError, "dtype"),
        ({"dtype": "float32"}, gg.DTypeError, "dtype"),
        ({"bias": 1}, gg.InvalidTypeError, "bias"),
        ({"separate_weights": "yes"}, gg.InvalidTypeError, "separate_weights"),
        ({"fuse_wgrad_accumulation": None}, gg.InvalidTypeError, "fuse_wgrad_accumulation"),
    ],
)
def test_constructor_errors_name_the_argument(kwargs, error, match):
    args = {"num_groups": 2, "in_features": 8, "out_features": 4, **kwargs}
    with pytest.raises(error, match=match):
        gg.GroupedLinear(args.pop("num_groups"), args.pop("in_features"), args.pop("out_features"), **args)


@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("splits", [[7, 0, 20, 3], [0, 0, 0, 0], [30, 0, 0, 0]])
def test_module_matches_float64_expert_linears(separate, bias, splits, gen):
    torch.manual_seed(1)
    layer = gg.GroupedLinear(4, 24, 10, bias=bias, recipe="fp32", separate_weights=separate)
    linears = expert_linears(layer)
    m = sum(splits)
    x = torch.randn(m, 24, generator=gen, requires_grad=True)
    x64 = x.detach().double().requires_grad_()
    dy = torch.randn(m, 10, generator=gen)
    y = layer(x, splits)
    y64 = run_experts(linears, x64, splits)
    y.backward(dy)
    y64.backward(dy.double())
    assert y.shape == (m, 10)
    assert rel_error(y, y64) < 1e-5
    assert rel_error(x.grad, x64.grad) < 1e-5
    dw = torch.stack([p.grad for p in layer.weights]) if separate else layer.weight.grad
    assert rel_error(dw, torch.stack([lin.weight.grad for lin in linears])) < 1e-5
    if bias:
        db = torch.stack([p.grad for p in layer.biases]) if separate else layer.bias.grad
        assert rel_error(db, torch.stack([lin.bias.grad for lin in linears])) < 1e-5


def test_separate_and_stacked_checkpoints_convert(gen):
    stacked = gg.GroupedLinear(3, 16, 8, recipe="fp32")
    separate = gg.GroupedLinear(3, 16, 8, recipe="fp32", separate_weights=True)
    state = stacked.state_dict()
    converted = {f"weight{g}": state["weight"][g] for g in range(3)} | {f"bias{g}": state["bias"][g] for g in range(3)}
    separate.load_state_dict(converted)
    x = torch.randn(20, 16, generator=gen)
    assert torch.equal(stacked(x, [5, 10, 5]), separate(x, [5, 10, 5]))


def test_preallocated_out_is_honoured(gen):
    layer = gg.GroupedLinear(3, 16, 8)
    x = torch.randn(20, 16, generator=gen).bfloat16()
    out = poison(torch.empty(20, 8, dtype=torch.bfloat16))
    y = layer(x, [5, 0, 15], out=out)
    assert y.data_ptr() == out.data_ptr()
    with torch.no_grad():
        want = run_experts(expert_linears(layer), x.double(), [5, 0, 15])
    assert rel_error(out, want) < 1e-2


def test_fused_wgrad_accumulation_through_the_module(gen):
    layer = gg.GroupedLinear(3, 16, 8, fuse_wgrad_accumulation=True)
    layer.weight.main_grad = torch.zeros(3, 8, 16)
    x = torch.randn(20, 16, generator=gen).bfloat16()
    dy = torch.randn(20, 8, generator=gen).bfloat16()
    layer(x, [5, 0, 15]).backward(dy)
    layer(x, [5, 0, 15]).backward(dy)
    assert rel_error(layer.weight.main_grad, 2 * ref_wgrad(dy, x, [5, 0, 15])) < 1e-5
    assert layer.weight.grad is None
    assert layer.bias.grad is not None


def test_fused_wgrad_without_main_grad_fails_in_forward(gen):
    layer = gg.GroupedLinear(2, 16, 8, fuse_wgrad_accumulation=True)
    x = torch.randn(4, 16, generator=gen).bfloat16()
    with pytest.raises(gg.InvalidArgumentError, match="main_grad"):
        layer(x, [2, 2])
    with torch.no_grad():
        assert layer(x, [2, 2]).shape == (4, 8)


def test_input_dtype_must_match_recipe(gen):
    layer = gg.GroupedLinear(2, 16, 8)
    with pytest.raises(gg.DTypeError, match="x"):
        layer(torch.randn(4, 16, generator=gen), [2, 2])


def test_extra_repr_names_the_configuration():
    text = repr(gg.GroupedLinear(2, 16, 8, recipe="fp32", separate_weights=True))
    assert "num_groups=2" in text and "recipe=fp32" in text and "separate_weights=True" in text


@pytest.fixture
def on_reference():
    """MX tests run on the reference backend (kernel backends run in the Triton interpreter
    on a CPU, far too slowly for these)."""
    with gg.use_backends("reference", strict=True):
        yield


def _mx_layer(recipe: str = "mxfp8", **kwargs) -> gg.GroupedLinear:
    torch.manual_seed(3)
    return gg.GroupedLinear(4, 64, 32, recipe=recipe, **kwargs)


def _bias(layer: gg.GroupedLinear, splits: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(layer.bias.detach(), torch.tensor(splits), dim=0)


def _per_call(layer: gg.GroupedLinear, x: torch.Tensor, dy: torch.Tensor, splits: list[int]):
    """Output and dx of the layer's current weights through the plain API (eager reference)."""
    w = layer.weight.detach()
    y = gg.grouped_gemm(x.detach(), w, splits, recipe=layer.recipe) + _bias(layer, splits)
    return y, gg.grouped_gemm_dgrad(dy, w, splits, recipe=layer.recipe)


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4", "a8w4", "a16w4"])
def test_mx_weight_updates_are_seen_by_the_next_call(on_reference, recipe, gen):
    """Every call quantizes the current master weights: after each optimizer step the
    output and dx equal the plain API on the updated weights, bit for bit."""
    layer = _mx_layer(recipe)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    splits = [16, 0, 24, 8]
    x = torch.randn(48, 64, generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(48, 32, generator=gen).bfloat16()
    outputs = []
    for _ in range(3):
        x.grad = None
        y = layer(x, splits)
        y.backward(dy)
        want_y, want_dx = _per_call(layer, x, dy, splits)
        assert torch.equal(y, want_y) and torch.equal(x.grad, want_dx)
        outputs.append(y.detach())
        optimizer.step()
    assert not torch.equal(outputs[0], outputs[1]) and not torch.equal(outputs[1], outputs[2])


def test_mx_dgrad_refuses_weights_changed_after_forward(on_reference, gen):
    """dgrad quantizes the weight forward saved: autograd refuses one modified in between,
    so dgrad's copy can never silently differ from the forward's."""
    layer = _mx_layer()
    x = torch.randn(48, 64, generator=gen).bfloat16().requires_grad_()
    y = layer(x, [16, 0, 24, 8])
    with torch.no_grad():
        layer.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.float().sum().backward()


def test_mx_writes_through_data_are_seen(on_reference, gen):
    """No cache to go stale: even writes that bypass the version counter are seen."""
    layer = _mx_layer(bias=False)
    x = torch.randn(48, 64, generator=gen).bfloat16()
    splits = [16, 0, 24, 8]
    before = layer(x, splits)
    layer.weight.data.copy_(layer.weight.data * 2)  # no version bump
    assert torch.equal(layer(x, splits), 2 * before)  # scaling by 2 is exact in MX
    layer.weight.data = layer.weight.data / 2  # new storage
    assert torch.equal(layer(x, splits), before)


def test_mx_frozen_weights_quantize_once_and_refuse_when_stale(on_reference, gen):
    layer = _mx_layer(bias=False)
    x = torch.randn(48, 64, generator=gen).bfloat16()
    splits = [16, 0, 24, 8]
    with torch.no_grad():
        want = layer(x, splits)
    layer.freeze_quantized_weights()
    assert layer.frozen and "frozen_quantized_weights=True" in repr(layer)
    frozen = layer._frozen.quantized["fwd"]
    with torch.no_grad():
        assert torch.equal(layer(x, splits), want)
        # The frozen copy is what the forward multiplies: poison it and the output follows.
        frozen.scale.fill_(127 + 1)
        assert not torch.equal(layer(x, splits), want)
        layer.freeze_quantized_weights()
        layer.weight.mul_(2)  # an update after freezing ...
        with pytest.raises(gg.InvalidArgumentError, match="freeze_quantized_weights"):
            layer(x, splits)  # ... is refused, not silently ignored
        layer.freeze_quantized_weights()  # re-freezing picks the update up
        assert torch.equal(layer(x, splits), 2 * want)
    with pytest.raises(gg.InvalidArgumentError, match="requires_grad"):
        layer(x, splits)  # weights that train would make the copy stale
    layer.unfreeze_quantized_weights()
    assert not layer.frozen
    assert torch.equal(layer(x, splits), 2 * want)


def test_mx_frozen_weights_refuse_a_declared_untracked_write(on_reference, gen):
    """A write torch does not count (through ``.data`` here; a ``torch.distributed``
    broadcast is another) escapes the frozen layer's check until ``gg.mark_updated``
    declares it; then the layer refuses to run on its stale copy."""
    layer = _mx_layer(bias=False)
    x = torch.randn(48, 64, generator=gen).bfloat16()
    splits = [16, 0, 24, 8]
    for p in layer.parameters():
        p.requires_grad_(False)
    layer.freeze_quantized_weights()
    before = layer(x, splits)
    layer.weight.data.mul_(2)  # not counted by torch
    assert torch.equal(layer(x, splits), before)  # the documented blind spot
    gg.mark_updated(layer.weight)
    with pytest.raises(gg.InvalidArgumentError, match="freeze_quantized_weights"):
        layer(x, splits)
    layer.freeze_quantized_weights()
    assert torch.equal(layer(x, splits), 2 * before)


@pytest.mark.parametrize("declare", ["buffer", "weight.data"])
def test_mx_frozen_weights_refuse_a_write_declared_on_the_weights_memory(on_reference, gen, declare):
    """Weights that are views of a flat buffer (``weight.data = buffer[...]``, as
    Megatron-LM's DDP lays them out) and a broadcast into the buffer: ``gg.mark_updated(buffer)``,
    or of ``weight.data``, marked only the tensor object given, so the frozen layer kept
    running its copy of the old weights, silently. Declared writes now count per memory."""
    layer = _mx_layer(bias=False).requires_grad_(False)
    buffer = torch.zeros(8 + layer.weight.numel(), dtype=layer.weight.dtype)
    buffer[8:] = layer.weight.detach().flatten()
    layer.weight.data = buffer[8:].view(layer.weight.shape)
    x = torch.randn(48, 64, generator=gen).bfloat16()
    splits = [16, 0, 24, 8]
    layer.freeze_quantized_weights()
    before = layer(x, splits)
    buffer.data.mul_(2)  # not counted by torch (a torch.distributed broadcast is not either)
    gg.mark_updated(buffer if declare == "buffer" else layer.weight.data)
    with pytest.raises(gg.InvalidArgumentError, match="freeze_quantized_weights"):
        layer(x, splits)
    layer.freeze_quantized_weights()
    assert torch.equal(layer(x, splits), 2 * before)  # scaling by 2 is exact in MX


@pytest.mark.parametrize("optimizer", ["Adam", "AdamW"])
def test_mx_frozen_weights_refuse_a_fused_optimizer_step(on_reference, gen, optimizer):
    """A fused optimizer step (``fused=True``) writes the weights without bumping their
    version: a layer frozen between backward and step (to evaluate) kept running its copy of
    the old weights after the step, silently. Every optimizer step now declares the write on
    the frozen weights it holds and updated (and only on those)."""
    layer = _mx_layer(bias=False)
    bystander = _mx_layer(bias=False).requires_grad_(False)  # frozen, in no optimizer
    untrained = _mx_layer(bias=False).requires_grad_(False)  # frozen, held, no grad: not stepped
    step = getattr(torch.optim, optimizer)([*layer.parameters(), *untrained.parameters()], lr=0.5, fused=True)
    x = torch.randn(48, 64, generator=gen).bfloat16()
    splits = [16, 0, 24, 8]
    layer(x, splits).float().square().sum().backward()
    layer.freeze_quantized_weights()
    bystander.freeze_quantized_weights()
    untrained.freeze_quantized_weights()
    with torch.no_grad():
        before, other, kept = layer(x, splits), bystander(x, splits), untrained(x, splits)
    version = layer.weight._version
    step.step()
    assert layer.weight._version == version  # what the frozen layer's check could not see
    with torch.no_grad():
        with pytest.raises(gg.InvalidArgumentError, match="freeze_quantized_weights"):
            layer(x, splits)
        assert torch.equal(bystander(x, splits), other)
        assert torch.equal(untrained(x, splits), kept)
        layer.freeze_quantized_weights()
        after = layer(x, splits)
    assert torch.equal(after, gg.grouped_gemm(x, layer.weight.detach(), splits, recipe=layer.recipe))
    assert not torch.equal(after, before)


def test_mx_frozen_weights_refuse_weights_replaced_at_a_reused_address(on_reference, gen):
    """``weight.data = new`` twice (loading checkpoints) could hand the second replacement
    the freed address of the weights the copy was made from; the stamp then matched and the
    frozen copy of the original weights ran silently (6 of 10 tries on the CPU). The frozen
    copy now holds its sources' storage, so every such forward is refused."""
    x = torch.randn(48, 64, generator=gen).bfloat16()
    for _ in range(10):
        layer = _mx_layer(bias=False).requires_grad_(False)
        layer.freeze_quantized_weights()
        shape, dtype = layer.weight.shape, layer.weight.dtype
        layer.weight.data = torch.randn(shape, generator=gen).to(dtype)
        layer.weight.data = torch.randn(shape, generator=gen).to(dtype)
        with pytest.raises(gg.InvalidArgumentError, match="freeze_quantized_weights"):
            layer(x, [16, 0, 24, 8])


@pytest.mark.parametrize("separate", [False, True])
def test_mx_freeze_refuses_a_parametrized_weight(separate):
    """A parametrized weight (torch.nn.utils.parametrize) is a new tensor at every access:
    forwards were refused at random with advice to freeze again that could not help, and
    some ran on the stale copy after the source changed. Freezing it is refused, named."""
    from torch.nn.utils import parametrize

    class Half(torch.nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w * 0.5

    layer = gg.GroupedLinear(2, 32, 32, bias=False, recipe="mxfp8", separate_weights=separate)
    name = "weight1" if separate else "weight"
    parametrize.register_parametrization(layer, name, Half())
    with pytest.raises(gg.InvalidArgumentError, match=rf"^{name}=.*parametriz"):
        layer.freeze_quantized_weights()


def test_a_replaced_weight_of_another_shape_is_named(gen):
    """A weight parameter replaced by one with more experts was reported as a bad bias, or
    (without bias) as splits of the wrong length."""
    for bias in (True, False):
        layer = gg.GroupedLinear(3, 8, 4, bias=bias, dtype=torch.float32)
        layer.weight = torch.nn.Parameter(torch.randn(4, 4, 8, generator=gen))
        with pytest.raises(gg.ShapeError, match=r"^weight=.*\(3, 4, 8\)"):
            layer(torch.randn(5, 8, generator=gen), [2, 0, 3])


def test_mx_frozen_weights_give_input_gradients_with_backward_copy(on_reference, gen):
    layer = _mx_layer(separate_weights=True)
    for p in layer.parameters():
        p.requires_grad_(False)
    x = torch.randn(48, 64, generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(48, 32, generator=gen).bfloat16()
    splits = [16, 0, 24, 8]
    y = layer(x, splits)
    y.backward(dy)
    want_y, want_dx = y.detach(), x.grad.clone()
    layer.freeze_quantized_weights()
    with pytest.raises(gg.InvalidArgumentError, match="backward=True"):
        layer(x, splits)
    layer.freeze_quantized_weights(backward=True)
    x.grad = None
    y = layer(x, splits)
    y.backward(dy)
    assert torch.equal(y, want_y) and torch.equal(x.grad, want_dx)


def test_mx_freeze_rejects_plain_recipes_and_partial_blocks():
    with pytest.raises(gg.InvalidArgumentError, match="MX recipe"):
        gg.GroupedLinear(2, 64, 32).freeze_quantized_weights()
    layer = gg.GroupedLinear(2, 40, 32, recipe="mxfp8")
    with pytest.raises(gg.InvalidArgumentError, match="in_features=40"):
        layer.freeze_quantized_weights()
    layer = gg.GroupedLinear(2, 64, 40, recipe="mxfp8")
    layer.freeze_quantized_weights()  # dgrad's N=40 only matters with backward=True
    with pytest.raises(gg.InvalidArgumentError, match="out_features=40"):
        layer.freeze_quantized_weights(backward=True)
    with pytest.raises(gg.InvalidTypeError, match="backward"):
        layer.freeze_quantized_weights(backward=1)


def test_mx_separate_weights_match_stacked(on_reference, gen):
    stacked = _mx_layer()
    separate = _mx_layer(separate_weights=True)
    with torch.no_grad():
        for g in range(4):
            separate.weights[g].copy_(stacked.weight[g])
            separate.biases[g].copy_(stacked.bias[g])
    x = torch.randn(48, 64, generator=gen).bfloat16()
    assert torch.equal(stacked(x, [16, 0, 24, 8]), separate(x, [16, 0, 24, 8]))


def test_mx_unaligned_features_quantize_per_call(on_reference, gen):
    """K=40 is not a whole number of 32-blocks: the backend pads and quantizes per call."""
    layer = gg.GroupedLinear(2, 40, 24, recipe="mxfp8")
    x = torch.randn(10, 40, generator=gen).bfloat16().requires_grad_()
    y = layer(x, [3, 7])
    y.float().sum().backward()
    with torch.no_grad():
        want = run_experts(expert_linears(layer), x.double(), [3, 7])
    assert sqnr_db(y, want) > 25


def test_mx_fused_wgrad_accumulation(on_reference, gen):
    layer = _mx_layer(fuse_wgrad_accumulation=True)
    layer.weight.main_grad = torch.zeros(4, 32, 64)
    x = torch.randn(48, 64, generator=gen).bfloat16()
    dy = torch.randn(48, 32, generator=gen).bfloat16()
    layer(x, [16, 0, 24, 8]).backward(dy)
    assert sqnr_db(layer.weight.main_grad, ref_wgrad(dy, x, [16, 0, 24, 8])) > 22
    assert not layer.weight.main_grad[1].any()


@pytest.mark.gpu
@pytest.mark.parametrize("separate", [False, True])
def test_gpu_module_fwd_bwd_matches_float64(separate):
    """Qwen3-30B-A3B gate-up shape on 32 experts, skewed splits, bf16 on CUDA."""
    torch.manual_seed(0)
    g, m, k, n = 32, 8192, 2048, 1536
    splits = gg.skewed_splits(g, m)
    splits[1], splits[0] = 0, splits[0] + splits[1]
    layer = gg.GroupedLinear(g, k, n, device="cuda", separate_weights=separate)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    out = poison(torch.empty(m, n, device="cuda", dtype=torch.bfloat16))
    y = layer(x, torch.tensor(splits, device="cuda"), out=out)
    y.backward(dy)
    linears = [lin.cuda() for lin in expert_linears(layer)]
    x64 = x.detach().double().requires_grad_()
    y64 = run_experts(linears, x64, splits)
    y64.backward(dy.double())
    dw = torch.stack([p.grad for p in layer.weights]) if separate else layer.weight.grad
    db = torch.stack([p.grad for p in layer.biases]) if separate else layer.bias.grad
    print("\nGPU GroupedLinear backends:", gg.dispatch_stats()["selected"])
    # bf16 outputs: about 2^-9 relative rounding per element, plus the bias' second rounding.
    assert rel_error(out, y64) < 1e-2
    assert rel_error(x.grad, x64.grad) < 1e-2
    assert rel_error(dw, torch.stack([lin.weight.grad for lin in linears])) < 1e-2
    assert rel_error(db, torch.stack([lin.bias.grad for lin in linears])) < 1e-2
    assert not dw[1].any() and not db[1].any()


@pytest.mark.slow
def test_example_moe_layer_trains():
    """examples/moe_layer.py runs, its loss falls, and it reports the backends that ran."""
    script = Path(__file__).resolve().parents[1] / "examples" / "moe_layer.py"
    done = subprocess.run(
        [sys.executable, str(script), "--steps", "20"], capture_output=True, text=True, timeout=120, check=True
    )
    losses = [float(line.split()[-1]) for line in done.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 5 and losses[-1] < losses[0] / 4
    assert "grouped GEMM calls: 100 (5 per step)" in done.stdout
    assert "backend " in done.stdout
