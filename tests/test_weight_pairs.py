"""One read of the weight for fwd and dgrad in an MX training step (grouped_gemm.mx.weight_pairs).

On the CPU the paired quantizer is the two single ones; the hand-over from forward to
backward is tested with a probe backend that quantizes its weight through
``quantize_weight`` (as ``hip_mxfp8`` does) and the one-read predicate forced on. The GPU
test runs the real kernel under a GroupedLinear step on ``hip_mxfp8``'s route.
"""

from __future__ import annotations

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm.mx import WeightPairs, pairing, quantize_mx_weight, quantize_weight, weight_pairs
from grouped_gemm.mx import grouped as mx_grouped


def _same(a: gg.MXTensor, b: gg.MXTensor) -> bool:
    return (
        (a.fmt, a.axis, a.shape, a.pad) == (b.fmt, b.axis, b.shape, b.pad)
        and torch.equal(a.scale, b.scale)
        and torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    )


def _weight(gen: torch.Generator, g: int = 3, n: int = 64, k: int = 96) -> torch.Tensor:
    return torch.randn(g, n, k, generator=gen) * torch.exp2(torch.randint(-8, 8, (g, n, k), generator=gen).float())


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_pair_is_the_two_quantizations(fmt, gen):
    w = _weight(gen, n=40, k=70).to(torch.bfloat16)
    along_k, along_n = gg.quantize_mx_weight_pair(w, fmt, scale_rule="floor", pad=True)
    assert _same(along_k, quantize_mx_weight(w, fmt, op="fwd", scale_rule="floor", pad=True))
    assert _same(along_n, quantize_mx_weight(w, fmt, op="dgrad", scale_rule="floor", pad=True))
    listed_k, _ = gg.quantize_mx_weight_pair(list(w.unbind(0)), fmt, scale_rule="floor", pad=True)
    assert _same(listed_k, along_k)


def test_pair_refuses_bad_arguments_by_name():
    with pytest.raises(gg.InvalidArgumentError, match="fmt"):
        gg.quantize_mx_weight_pair(torch.zeros(2, 32, 32), "e3m3")
    with pytest.raises(gg.ShapeError, match="w"):
        gg.quantize_mx_weight_pair(torch.zeros(32, 32), "e4m3")
    with pytest.raises(gg.ShapeError, match="multiple of block_size"):
        gg.quantize_mx_weight_pair(torch.zeros(2, 40, 32), "e4m3")  # N not whole blocks, no pad
    with pytest.raises(gg.InvalidArgumentError, match="scale_rule"):
        gg.quantize_mx_weight_pair(torch.zeros(2, 32, 32), "e4m3", scale_rule="up")


@pytest.fixture
def one_read(monkeypatch):
    """Pretend the CPU quantizes both ways from one read, so the hand-over runs here."""
    monkeypatch.setattr(weight_pairs, "pairs_in_one_read", lambda w, fmt: True)


def test_dgrad_takes_the_copy_made_in_forward_once(one_read, gen):
    w = _weight(gen)
    pairs = WeightPairs()
    with pairing(pairs):
        along_k = quantize_weight(w, "e4m3", op="fwd")
    assert len(pairs) == 1 and _same(along_k, quantize_mx_weight(w, "e4m3"))
    with pairing(pairs):
        other_rule = quantize_weight(w, "e4m3", op="dgrad", scale_rule="floor")  # not what forward made
        assert len(pairs) == 1 and _same(other_rule, quantize_mx_weight(w, "e4m3", op="dgrad", scale_rule="floor"))
        along_n = quantize_weight(w, "e4m3", op="dgrad")
        assert len(pairs) == 0 and _same(along_n, quantize_mx_weight(w, "e4m3", op="dgrad"))
        again = quantize_weight(w, "e4m3", op="dgrad")  # handed over once; then quantized as usual
    assert again is not along_n and _same(again, along_n)


def test_a_weight_written_after_forward_is_quantized_anew(one_read, gen):
    w = _weight(gen)
    pairs = WeightPairs()
    with pairing(pairs):
        quantize_weight(w, "e4m3", op="fwd")
    w.mul_(-2)
    with pairing(pairs):
        along_n = quantize_weight(w, "e4m3", op="dgrad")
    assert _same(along_n, quantize_mx_weight(w, "e4m3", op="dgrad"))
    assert len(pairs) == 1  # the stale copy was not taken


def test_no_pairing_outside_a_store_or_without_one_read(gen):
    w = _weight(gen)
    pairs = WeightPairs()
    with pairing(pairs):  # the CPU: pairs_in_one_read is False, each op quantizes its own
        quantize_weight(w, "e4m3", op="fwd")
    assert len(pairs) == 0
    assert _same(quantize_weight(w, "e4m3", op="dgrad"), quantize_mx_weight(w, "e4m3", op="dgrad"))
    assert not mx_grouped.pairs_in_one_read(w, "e4m3")


class PairingProbe(gg.Backend):
    """mxfp8 fwd / dgrad on the CPU: quantizes the weight through ``quantize_weight`` (as a
    backend that quantizes its own weights does), then lets ``reference`` multiply."""

    spec = gg.BackendSpec(
        name="pairing_probe",
        ops=frozenset({"fwd", "dgrad"}),
        recipes=frozenset({"mxfp8"}),
        vendors=frozenset({"cpu"}),
        mx_formats=frozenset({"e4m3"}),
        host_splits=True,
        priority=1000,
    )

    def __init__(self) -> None:
        self.weights: list[tuple[str, gg.MXTensor]] = []

    def run(self, problem: gg.Problem, inputs: gg.GroupedInputs) -> torch.Tensor:
        w = quantize_weight(inputs.b, "e4m3", op=problem.op, scale_rule=problem.scale_rule)
        self.weights.append((problem.op, w))
        call = gg.grouped_gemm if problem.op == "fwd" else gg.grouped_gemm_dgrad
        return call(inputs.a, w, inputs.splits_list(), recipe=problem.recipe, backend="reference")


def _step(layer: gg.GroupedLinear, x: torch.Tensor, splits: list[int]) -> tuple[torch.Tensor, ...]:
    x = x.detach().requires_grad_()
    y = layer(x, splits)
    y.float().square().sum().backward()
    grads = (y.detach(), x.grad, layer.weight.grad)
    layer.zero_grad()
    return grads


def test_grouped_linear_quantizes_the_weight_once_a_step(one_read, register, monkeypatch, gen):
    probe = register(PairingProbe())
    calls = []
    real = weight_pairs.quantize_mx_weight_pair
    monkeypatch.setattr(weight_pairs, "quantize_mx_weight_pair", lambda *a, **k: calls.append(1) or real(*a, **k))
    layer = gg.GroupedLinear(4, 64, 96, bias=False, recipe="mxfp8")
    x = torch.randn(70, 64, generator=gen)
    splits = [30, 0, 33, 7]
    paired = _step(layer, x, splits)
    fwd, dgrad = probe.weights
    assert calls == [1] and fwd[0] == "fwd" and dgrad[0] == "dgrad"
    probe.weights.clear()
    gg.configure(pair_weights=False)
    unpaired = _step(layer, x, splits)
    assert calls == [1] and [op for op, _ in probe.weights] == ["fwd", "dgrad"]
    assert _same(dgrad[1], probe.weights[1][1])
    for a, b in zip(paired, unpaired, strict=True):
        assert torch.equal(a, b)


def test_no_pairing_where_no_dgrad_follows(one_read, register, monkeypatch, gen):
    register(PairingProbe())
    calls = []
    real = weight_pairs.quantize_mx_weight_pair
    monkeypatch.setattr(weight_pairs, "quantize_mx_weight_pair", lambda *a, **k: calls.append(1) or real(*a, **k))
    layer = gg.GroupedLinear(2, 32, 64, bias=False, recipe="mxfp8")
    x = torch.randn(20, 32, generator=gen)
    with torch.no_grad():
        layer(x, [12, 8])
    layer(x, [12, 8]).sum().backward()  # x needs no grad: backward runs wgrad only
    assert calls == []


def test_pair_weights_reads_its_environment_variable(monkeypatch):
    monkeypatch.setenv("GROUPED_GEMM_PAIR_WEIGHTS", "0")
    assert gg.reset_config().pair_weights is False
    monkeypatch.setenv("GROUPED_GEMM_PAIR_WEIGHTS", "maybe")
    with pytest.raises(gg.ConfigError, match="GROUPED_GEMM_PAIR_WEIGHTS"):
        gg.reset_config()
    monkeypatch.delenv("GROUPED_GEMM_PAIR_WEIGHTS")
    assert gg.reset_config().pair_weights is True
