"""Adversarial numerics: ambient torch state that must not change a call's numbers.

Each test compares against the float64 product of the operands: a result in the right
dtype but computed in another precision raises nothing, so only the numbers tell.
"""

from __future__ import annotations

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm.testing import ref_dgrad, ref_fwd, ref_wgrad, rel_error

CALLS = {"fwd": gg.grouped_gemm, "dgrad": gg.grouped_gemm_dgrad, "wgrad": gg.grouped_gemm_wgrad}
REFS = {"fwd": ref_fwd, "dgrad": ref_dgrad, "wgrad": ref_wgrad}
#: fp32 results of fp32 operands; bf16 rounding of the operands would give ~3e-3.
FP32_TOL = 1e-5


def _operands(op: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    splits = [3, 0, 5]
    m, g, n, k = sum(splits), len(splits), 5, 7  # unaligned: torch_grouped_mm declines
    shapes = {"fwd": ((m, k), (g, n, k)), "dgrad": ((m, n), (g, n, k)), "wgrad": ((m, n), (m, k))}[op]
    a, b = (torch.randn(*s, generator=gen) for s in shapes)
    return a, b, splits


@pytest.mark.parametrize("backend", ["reference", "padded_bmm"])
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_fp32_call_under_autocast_computes_in_fp32(op, backend, dtype, gen):
    """The recipe decides the formats, not ``torch.autocast`` (docs/module.md): these
    backends' matmuls ran in the region's bf16/fp16 and returned fp32 results with bf16
    precision, silently (the default route on the CPU for unaligned shapes)."""
    a, b, splits = _operands(op, gen)
    with torch.autocast("cpu", dtype=dtype):
        got = CALLS[op](a, b, splits, backend=backend)
    assert got.dtype == torch.float32
    assert rel_error(got, REFS[op](a.double(), b.double(), splits)) < FP32_TOL


@pytest.mark.parametrize("recipe", ["mxfp8", "a16w4"])
def test_the_reference_mx_product_ignores_autocast(recipe, gen):
    """``reference`` is the MX ground truth: under autocast it multiplied the dequantized
    operands in bf16, a different answer from the same quantized operands."""
    x, w = torch.randn(8, 64, generator=gen), torch.randn(3, 32, 64, generator=gen)
    qw = gg.quantize_mx_weight(w.bfloat16(), "e4m3" if recipe == "mxfp8" else "e2m1")
    xs = x.bfloat16() if recipe == "a16w4" else gg.quantize_mx(x, "e4m3")
    want = ref_fwd(xs if recipe == "a16w4" else xs.dequantize(torch.float64), qw.dequantize(torch.float64), [3, 0, 5])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = gg.grouped_gemm(xs, qw, [3, 0, 5], recipe=recipe, backend="reference", out_dtype=torch.float32)
    assert rel_error(got, want) < FP32_TOL


def test_an_fp32_layer_under_autocast_returns_fp32_numbers(gen):
    """docs/module.md: an fp32 layer in a bf16 autocast region computes and returns fp32;
    with unaligned features its GEMMs ran on padded_bmm in bf16."""
    torch.manual_seed(0)
    layer = gg.GroupedLinear(3, 7, 5, dtype=torch.float32)
    x = torch.randn(8, 7, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x, [3, 0, 5])
    want = ref_fwd(x.double(), layer.weight.detach().double(), [3, 0, 5])
    want += torch.repeat_interleave(layer.bias.detach().double(), torch.tensor([3, 0, 5]), dim=0)
    assert y.dtype == torch.float32 and rel_error(y, want) < FP32_TOL


def test_a_plugin_matmul_backend_is_not_autocast_by_the_caller(make_backend, gen):
    """A third-party backend written with plain ``@`` (conftest's FakeBackend) and chosen
    for an fp32 forward returned bf16-precision numbers inside a bf16 autocast region: the
    dispatcher now runs every backend with the region off."""
    make_backend("matmul_plugin", priority=1000)
    a, b, splits = _operands("fwd", gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = gg.grouped_gemm(a, b, splits, backend="matmul_plugin")
    assert rel_error(got, ref_fwd(a.double(), b.double(), splits)) < FP32_TOL
