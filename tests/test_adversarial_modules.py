"""Adversarial cases from the module pass: ``GroupedLinear`` (checkpoints, casts, copies,
frozen MX weights, ``main_grad``), the custom ops and ``ops.gmm``, expert parallelism.
Each failed before its fix; CPU only, small shapes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import grouped_gemm as gg

G, K, N = 3, 8, 4
SPLITS = [2, 0, 5]

# ---- main_grad buffers that alias another expert's weight or buffer ---------------------------


def _views_one_row_apart(flat: torch.Tensor) -> list[torch.Tensor]:
    """G ``(N, K)`` views of ``flat`` whose starts are one row apart: each overlaps the next."""
    return [flat[g * K : g * K + N * K].view(N, K) for g in range(G)]


ALIASING_MAIN_GRADS: dict[str, Callable[[gg.GroupedLinear], list[torch.Tensor]]] = {
    "one_buffer_for_every_expert": lambda layer: [torch.zeros(N, K)] * G,
    "another_experts_weight": lambda layer: [torch.zeros(N, K), layer.weight0.data, torch.zeros(N, K)],
    "overlapping_views": lambda layer: _views_one_row_apart(torch.zeros(G * N * K)),
}


@pytest.mark.parametrize("bad", list(ALIASING_MAIN_GRADS))
def test_a_main_grad_aliasing_another_expert_is_named_at_forward(bad, gen):
    """Only a main_grad sharing its *own* weight's memory was refused: one overlapping
    another expert's weight ran, and wgrad added into that weight silently; buffers
    shared between experts failed in backward as ``out=...`` (never passed by the caller)."""
    layer = gg.GroupedLinear(G, K, N, recipe="fp32", separate_weights=True, fuse_wgrad_accumulation=True)
    before = [w.detach().clone() for w in layer.weights]
    for w, buf in zip(layer.weights, ALIASING_MAIN_GRADS[bad](layer), strict=True):
        w.main_grad = buf
    x = torch.randn(sum(SPLITS), K, generator=gen, requires_grad=True)
    with pytest.raises(gg.InvalidArgumentError, match=r"^weight[12]\.main_grad=.*overlaps weight[01]"):
        layer(x, SPLITS)
    assert all(torch.equal(w, b) for w, b in zip(layer.weights, before, strict=True))


def test_distinct_main_grads_in_one_flat_buffer_accumulate(gen):
    """Megatron's layout: every main_grad a view into one flat grad buffer, back to back."""
    layer = gg.GroupedLinear(G, K, N, recipe="fp32", separate_weights=True, fuse_wgrad_accumulation=True, bias=False)
    flat = torch.randn(G * N * K, generator=gen)
    start = flat.clone()
    for g, w in enumerate(layer.weights):
        w.main_grad = flat[g * N * K : (g + 1) * N * K].view(N, K)
    x = torch.randn(sum(SPLITS), K, generator=gen, dtype=torch.float64)
    dy = torch.randn(sum(SPLITS), N, generator=gen, dtype=torch.float64)
    layer(x.float(), SPLITS).backward(dy.float())
    want = torch.cat([d.T @ a for d, a in zip(dy.split(SPLITS), x.split(SPLITS), strict=True)]).flatten()
    assert torch.allclose(flat.double() - start.double(), want, atol=1e-5, rtol=1e-5)
