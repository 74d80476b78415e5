"""The reference backend's MX recipes, fwd / dgrad / wgrad.

Against float64 math on the same dequantized inputs (only the accumulation differs:
SQNR >= 60 dB), and against the unquantized float64 result on random normal data (the
recipe's own error: MXFP8 >= 25 dB, MXFP4-class >= 12 dB)."""

from __future__ import annotations

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm.testing import (
    RECIPE_VS_UNQUANTIZED_DB,
    SAME_FUNCTION_DB,
    poison,
    random_splits,
    ref_dgrad,
    ref_fwd,
    ref_wgrad,
    sqnr_db,
)

RECIPES = ["mxfp8", "mxfp8_e5m2", "mxfp4", "a8w4", "a16w4"]
SPLITS = {
    "skewed": [3, 0, 120, 1, 36],
    "g1": [77],
    "all_empty": [0, 0, 0],
    "aligned": [32, 64, 0, 32],
}
#: Recipe vs unquantized math on N(0, 1) data: the library's floors (grouped_gemm.testing).
#: E5M2 gradients round-trip at about 25.5 dB on their own (docs/mx_formats.md), so their
#: products with E4M3 weights land near 24 dB: that case gets 22.
VS_UNQUANTIZED_DB = {**RECIPE_VS_UNQUANTIZED_DB, "mxfp8_e5m2": 22.0}


def recipe_of(name: str) -> gg.Recipe:
    if name == "mxfp8_e5m2":
        return gg.get_recipe("mxfp8").model_copy(update={"grad_format": "e5m2"})
    return gg.get_recipe(name)


def q(t, fmt, axis, rule):
    """What the reference should see: ``t`` quantized-dequantized, or as it is."""
    return t if fmt is None else gg.quantize_mx(t, fmt, axis=axis, scale_rule=rule, pad=True).dequantize()


def q_rows(t, fmt, splits, rule):
    return t if fmt is None else gg.quantize_mx_rows(t, splits, fmt, scale_rule=rule).dequantize()


def check(out, want_same_inputs, want_unquantized, recipe):
    assert torch.isfinite(out).all()
    if want_same_inputs.abs().sum() == 0:
        assert (out == 0).all()
        return
    assert sqnr_db(out, want_same_inputs) >= SAME_FUNCTION_DB
    assert sqnr_db(out, want_unquantized) >= VS_UNQUANTIZED_DB[recipe]


@pytest.mark.parametrize("rule", ["rceil", "floor", "even"])
@pytest.mark.parametrize("splits", list(SPLITS), ids=list(SPLITS))
@pytest.mark.parametrize("name", RECIPES)
def test_fwd_and_dgrad(gen, name, splits, rule):
    recipe = recipe_of(name).model_copy(update={"scale_rule": rule})
    sizes = SPLITS[splits]
    m, n, k = sum(sizes), 96, 72  # K = 72: not a block multiple, zero-padded to 96
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(len(sizes), n, k, generator=gen)
    dy = torch.randn(m, n, generator=gen)
    out = poison(torch.empty(m, n))
    got = gg.grouped_gemm(x, w, sizes, recipe=recipe, out=out, backend="reference")
    assert got is out
    xq, wq = q(x, recipe.act_format, 1, rule), q(w, recipe.weight_format, 2, rule)
    check(got, ref_fwd(xq, wq, sizes), ref_fwd(x, w, sizes), name)
    out = poison(torch.empty(m, k))
    got = gg.grouped_gemm_dgrad(dy, w, sizes, recipe=recipe, out=out, backend="reference")
    dyq, wq = q(dy, recipe.grad_format, 1, rule), q(w, recipe.weight_format, 1, rule)
    check(got, ref_dgrad(dyq, wq, sizes), ref_dgrad(dy, w, sizes), name)


@pytest.mark.parametrize("splits", list(SPLITS), ids=list(SPLITS))
@pytest.mark.parametrize("name", RECIPES)
def test_wgrad_quantizes_along_m_per_group(gen, name, splits):
    recipe = recipe_of(name)
    sizes = SPLITS[splits]
    m, n, k = sum(sizes), 40, 64
    dy = torch.randn(m, n, generator=gen)
    x = torch.randn(m, k, generator=gen)
    out = poison(torch.empty(len(sizes), n, k))
    got = gg.grouped_gemm_wgrad(dy, x, sizes, recipe=recipe, out=out, backend="reference")
    dyq = q_rows(dy, recipe.grad_format, sizes, "rceil")
    xq = q_rows(x, recipe.act_format, sizes, "rceil")
    check(got, ref_wgrad(dyq, xq, sizes), ref_wgrad(dy, x, sizes), name)
    # accumulate adds into the buffer and leaves empty groups' slices untouched
    base = torch.randn(len(sizes), n, k, generator=gen)
    acc = base.clone()
    gg.grouped_gemm_wgrad(dy, x, sizes, recipe=recipe, out=acc, accumulate=True, backend="reference")
    assert sqnr_db(acc, base.double() + ref_wgrad(dyq, xq, sizes)) >= SAME_FUNCTION_DB
    for g, rows in enumerate(sizes):
        if rows == 0:
            assert torch.equal(acc[g], base[g])


def test_bf16_inputs_and_output(gen):
    sizes = random_splits(6, 400, empty=1, generator=gen)
    x = torch.randn(400, 256, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(6, 128, 256, generator=gen, dtype=torch.bfloat16)
    got = gg.grouped_gemm(x, w, sizes, recipe="mxfp8", backend="reference")
    assert got.dtype == torch.bfloat16
    assert sqnr_db(got, ref_fwd(q(x, "e4m3", 1, "rceil"), q(w, "e4m3", 2, "rceil"), sizes)) >= 45.0  # bf16 output
    assert sqnr_db(got, ref_fwd(x, w, sizes)) >= 25.0


def test_prequantized_operands_are_used_as_given(gen):
    sizes = [10, 0, 22]
    x = torch.randn(32, 64, generator=gen)
    w = torch.randn(3, 32, 64, generator=gen)
    # weights quantized with FLOOR, the call's recipe says RCEIL: the given bytes win
    wq = gg.quantize_mx_weight(w, "e2m1", scale_rule="floor")
    xq = gg.quantize_mx(x, "e4m3", scale_rule="floor")
    got = gg.grouped_gemm(xq, wq, sizes, backend="reference", out_dtype=torch.float32)  # recipe inferred: a8w4
    assert sqnr_db(got, ref_fwd(xq.dequantize(), wq.dequantize(), sizes)) >= SAME_FUNCTION_DB
    plain = gg.grouped_gemm(x, wq, sizes, backend="reference")  # a16w4
    assert sqnr_db(plain, ref_fwd(x, wq.dequantize(), sizes)) >= SAME_FUNCTION_DB
    dgrad_w = gg.quantize_mx_weight(w, "e2m1", op="dgrad")
    dy = torch.randn(32, 32, generator=gen)
    got = gg.grouped_gemm_dgrad(dy, dgrad_w, sizes, backend="reference")
    assert sqnr_db(got, ref_dgrad(dy, dgrad_w.dequantize(), sizes)) >= SAME_FUNCTION_DB


def test_gpt_oss_checkpoint_layout(gen):
    """gpt-oss ships MoE weights as blocks (E, N, K/32, 16) uint8 + scales (E, N, K/32)."""
    e, n, k = 4, 64, 96
    blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(118, 130, (e, n, k // 32), generator=gen, dtype=torch.uint8)
    w = gg.MXTensor.from_blocks(blocks, scales)
    assert w.data.data_ptr() == blocks.data_ptr() and w.scale.data_ptr() == scales.data_ptr()  # no copy
    assert (w.shape, w.axis, w.fmt) == ((e, n, k), 2, "e2m1")
    # element 2i is the low nibble of byte i
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    first = table[(blocks[0, 0, 0, 0] & 0xF).long()] * 2.0 ** (scales[0, 0, 0].item() - 127)
    second = table[(blocks[0, 0, 0, 0] >> 4).long()] * 2.0 ** (scales[0, 0, 0].item() - 127)
    assert w.dequantize()[0, 0, :2].tolist() == [first.item(), second.item()]
    sizes = [5, 0, 40, 3]
    x = torch.randn(48, k, generator=gen, dtype=torch.bfloat16)
    out = poison(torch.empty(48, n, dtype=torch.float32))
    gg.grouped_gemm(x, w, sizes, out=out, backend="reference")
    assert sqnr_db(out, ref_fwd(x, w.dequantize(), sizes)) >= SAME_FUNCTION_DB


def test_prequantized_wgrad_operands(gen):
    sizes = [32, 0, 64]
    dy = torch.randn(96, 40, generator=gen)
    x = torch.randn(96, 64, generator=gen)
    dyq = gg.quantize_mx(dy, "e4m3", axis=0)
    xq = gg.quantize_mx(x, "e4m3", axis=0)
    got = gg.grouped_gemm_wgrad(dyq, xq, sizes, backend="reference", out_dtype=torch.float32)
    assert sqnr_db(got, ref_wgrad(dyq.dequantize(), xq.dequantize(), sizes)) >= SAME_FUNCTION_DB
    # with host splits, a group that is not a whole number of blocks is refused up front
    with pytest.raises(gg.SplitsError, match=r"multiples of 32 when dy is an MXTensor.*m_splits\[0\]=30"):
        gg.grouped_gemm_wgrad(dyq, xq, [30, 2, 64], backend="reference")
