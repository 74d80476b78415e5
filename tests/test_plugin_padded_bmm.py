"""The padded_bmm example plugin computes the right thing, host and device splits alike."""

from __future__ import annotations

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm.testing import poison, random_splits, ref_dgrad, ref_fwd, ref_wgrad, rel_error

padded = pytest.importorskip("grouped_gemm_padded_bmm", reason="example plugin not installed (plugins/padded_bmm)")


@pytest.mark.parametrize(("groups", "m", "empty"), [(1, 9, 0), (5, 37, 2), (4, 0, 0)])
def test_three_ops(gen, groups, m, empty):
    splits = random_splits(groups, m, empty=empty, generator=gen) if m else [0] * groups
    x, w, dy = torch.randn(m, 24, generator=gen), torch.randn(groups, 8, 24, generator=gen), torch.randn(m, 8)
    out = gg.grouped_gemm(x, w, splits, out=poison(torch.empty(m, 8)), backend="padded_bmm")
    assert m == 0 or rel_error(out, ref_fwd(x, w, splits)) < 1e-5
    dx = gg.grouped_gemm_dgrad(dy, w, splits, backend="padded_bmm")
    assert m == 0 or rel_error(dx, ref_dgrad(dy, w, splits)) < 1e-5
    dw = gg.grouped_gemm_wgrad(dy, x, splits, out=poison(torch.empty(groups, 8, 24)), backend="padded_bmm")
    assert torch.isfinite(dw).all()
    assert torch.allclose(dw.double(), ref_wgrad(dy, x, splits), atol=1e-4, rtol=1e-5)
    main = torch.randn(groups, 8, 24, generator=gen)
    expect = main.double() + ref_wgrad(dy, x, splits)
    gg.grouped_gemm_wgrad(dy, x, splits, out=main, accumulate=True, backend="padded_bmm")
    assert rel_error(main, expect) < 1e-6


def test_device_split_path_pads_to_capacity(gen, monkeypatch):
    monkeypatch.setenv(padded.CAPACITY_ENV, "16")
    splits = [5, 0, 16, 3]
    x, w = torch.randn(24, 12, generator=gen), torch.randn(4, 8, 12, generator=gen)
    problem = gg.describe_problem(groups=4, m=24, n=8, k=12, recipe="fp32", device_splits=True)
    backend = padded.PaddedBmmBackend()
    assert backend.check(problem) == []
    inputs = gg.GroupedInputs(x, w, torch.tensor(splits))
    assert rel_error(backend.run(problem, inputs), ref_fwd(x, w, splits)) < 1e-5


def test_fp32_accumulation_of_bf16_inputs_is_not_rounded_to_bf16(gen):
    splits = [40, 0, 24]
    dy = torch.randn(64, 16, generator=gen).bfloat16()
    x = torch.randn(64, 32, generator=gen).bfloat16()
    main = torch.zeros(3, 16, 32)
    gg.grouped_gemm_wgrad(dy, x, splits, out=main, accumulate=True, backend="padded_bmm")
    assert rel_error(main, ref_wgrad(dy, x, splits)) < 1e-6


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_bad_capacity_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(padded.CAPACITY_ENV, value)
    with pytest.raises(gg.ConfigError, match=padded.CAPACITY_ENV):
        padded.configured_capacity()


@pytest.mark.gpu
def test_capturable_with_device_splits(monkeypatch):
    monkeypatch.setenv(padded.CAPACITY_ENV, "512")
    dev = torch.device("cuda")
    splits = torch.tensor([100, 0, 512, 300], device=dev)
    x = torch.randn(912, 256, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4, 128, 256, device=dev, dtype=torch.bfloat16)
    out = gg.grouped_gemm(x, w, splits, backend="padded_bmm")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gg.grouped_gemm(x, w, splits, backend="padded_bmm")
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_error(captured, ref_fwd(x, w, splits.tolist())) < 8e-3
    assert out.shape == captured.shape


def test_refuses_splits_whose_padding_is_large(gen):
    """G=16 with one big group would pad 15 one-row groups to thousands of rows."""
    splits = [4081] + [1] * 15
    x, w = torch.randn(4096, 16, generator=gen), torch.randn(16, 8, 16, generator=gen)
    decision = gg.explain(x, w, splits)
    reasons = decision.candidate("padded_bmm").reasons
    assert [r.code for r in reasons] == ["shape"]
    assert "too uneven" in reasons[0].message and "M's bucket (4096 rows)" in reasons[0].message
    gg.configure(strict=True)
    with pytest.raises(gg.BackendUnavailableError, match=r"(?s)padded_bmm.*too uneven"):
        gg.grouped_gemm(x, w, splits, backend="padded_bmm")
    balanced = [256] * 16
    assert gg.explain(x, w, balanced).candidate("padded_bmm").eligible


def test_ranks_below_torch_grouped_mm_on_cpu(gen):
    """On CPU the padding is real work that torch._grouped_mm does not do."""
    x, w = torch.randn(64, 16, generator=gen), torch.randn(4, 8, 16, generator=gen)
    decision = gg.explain(x, w, [16] * 4)
    names = [c.name for c in decision.candidates]
    assert names.index("torch_grouped_mm") < names.index("padded_bmm")
    assert decision.selected == "torch_grouped_mm"
