"""The reference backend against float64 math: every op, dtype and awkward split."""

from __future__ import annotations

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm.testing import poison, random_splits, ref_dgrad, ref_fwd, ref_wgrad, rel_error

# fp32 matmuls land far under 1e-5; bf16/fp16 outputs are limited by their own rounding.
TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _case(gen, groups, m, n, k, dtype, *, empty=0):
    splits = random_splits(groups, m, empty=empty, generator=gen) if m else [0] * groups
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(groups, n, k, generator=gen).to(dtype)
    dy = torch.randn(m, n, generator=gen).to(dtype)
    return splits, x, w, dy


SHAPES = [
    pytest.param(1, 17, 24, 40, 0, id="G1"),
    pytest.param(5, 61, 33, 7, 2, id="unaligned-empty"),
    pytest.param(8, 64, 16, 32, 0, id="balanced-ish"),
    pytest.param(4, 0, 16, 32, 0, id="M0"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("groups", "m", "n", "k", "empty"), SHAPES)
def test_three_ops_match_float64(gen, dtype, groups, m, n, k, empty):
    splits, x, w, dy = _case(gen, groups, m, n, k, dtype, empty=empty)
    out = poison(torch.empty(m, n, dtype=dtype))
    got = gg.grouped_gemm(x, w, splits, out=out, backend="reference")
    assert got is out
    assert rel_error(got, ref_fwd(x, w, splits)) < TOL[dtype] or m == 0
    dx = gg.grouped_gemm_dgrad(dy, w, splits, backend="reference")
    assert dx.shape == (m, k) and dx.dtype == dtype
    assert rel_error(dx, ref_dgrad(dy, w, splits)) < TOL[dtype] or m == 0
    dw = gg.grouped_gemm_wgrad(dy, x, splits, out=poison(torch.empty(groups, n, k, dtype=dtype)), backend="reference")
    expected = ref_wgrad(dy, x, splits)
    assert torch.isfinite(dw).all()
    if m:
        assert rel_error(dw, expected) < TOL[dtype]
    for g, rows in enumerate(splits):
        if rows == 0:
            assert torch.count_nonzero(dw[g]) == 0


def test_skewed_splits(gen):
    splits = gg.skewed_splits(16, 2048)
    assert sum(splits) == 2048 and max(splits) > 3 * (2048 // 16)
    x = torch.randn(2048, 64, generator=gen)
    w = torch.randn(16, 48, 64, generator=gen)
    assert rel_error(gg.grouped_gemm(x, w, splits, backend="reference"), ref_fwd(x, w, splits)) < 1e-5


def test_weight_list_and_out_dtype(gen):
    splits, x, w, _ = _case(gen, 3, 30, 8, 16, torch.bfloat16)
    got = gg.grouped_gemm(x, list(w), splits, out_dtype=torch.float32, backend="reference")
    assert got.dtype == torch.float32
    assert rel_error(got, ref_fwd(x, w, splits)) < 1e-5


def test_host_tensor_splits_equal_list(gen):
    splits, x, w, _ = _case(gen, 4, 40, 8, 16, torch.float32, empty=1)
    a = gg.grouped_gemm(x, w, torch.tensor(splits, dtype=torch.int32), backend="reference")
    b = gg.grouped_gemm(x, w, tuple(splits), backend="reference")
    assert torch.equal(a, b)


def test_wgrad_accumulates_into_fp32_main_grad(gen):
    splits, x, _, dy = _case(gen, 4, 40, 8, 16, torch.bfloat16, empty=1)
    main_grad = torch.randn(4, 8, 16, generator=gen)
    before = main_grad.clone()
    got = gg.grouped_gemm_wgrad(dy, x, splits, out=main_grad, accumulate=True, backend="reference")
    assert got is main_grad
    expected = before.double() + ref_wgrad(dy, x, splits)
    assert rel_error(main_grad, expected) < 1e-6
    for g, rows in enumerate(splits):
        if rows == 0:
            assert torch.equal(main_grad[g], before[g])


def test_wgrad_into_list_of_per_expert_buffers(gen):
    splits, x, _, dy = _case(gen, 3, 24, 8, 16, torch.float32)
    outs = [poison(torch.empty(8, 16)) for _ in range(3)]
    got = gg.grouped_gemm_wgrad(dy, x, splits, out=outs, backend="reference")
    assert all(a is b for a, b in zip(got, outs, strict=True))
    assert rel_error(torch.stack(outs), ref_wgrad(dy, x, splits)) < 1e-5


def test_non_contiguous_inputs(gen):
    splits, x, w, _ = _case(gen, 3, 24, 8, 16, torch.float32)
    xt = x.T.contiguous().T
    wt = w.transpose(1, 2).contiguous().transpose(1, 2)
    assert not xt.is_contiguous() and not wt.is_contiguous()
    assert rel_error(gg.grouped_gemm(xt, wt, splits, backend="reference"), ref_fwd(x, w, splits)) < 1e-5
