"""An adversarial numerics pass over the Triton backends in Triton's CPU interpreter.

Edge values the interpreter handles differently from a GPU, on the public API with the
backend named (strict: no silent fallback), outputs NaN-poisoned first: the result must
match the float64 product of the operands (plain recipes) or the ``reference`` backend on
the same quantized operands (MX recipes).
"""

from __future__ import annotations

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm.backends.triton_mx import launch
from grouped_gemm.device import emulated
from grouped_gemm.testing import poison, ref_dgrad, ref_fwd, ref_wgrad, rel_error, sqnr_db

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or not launch.interpreted(), reason="CPU tests run the kernels in Triton's interpreter"
)

SPLITS = [5, 0, 11]
N, K = 64, 96
#: As tests/test_triton_grouped.py: fp32 results of exact 16-bit products.
FP32_OUT_TOL = 1e-5
#: As tests/test_triton_mxfp4.py: against ``reference`` on the same quantized operands.
MIN_SQNR = 60.0
CALLS = {"fwd": gg.grouped_gemm, "dgrad": gg.grouped_gemm_dgrad, "wgrad": gg.grouped_gemm_wgrad}
REFS = {"fwd": ref_fwd, "dgrad": ref_dgrad, "wgrad": ref_wgrad}
BACKENDS = {"bf16": "triton_grouped", "a16w4": "triton_mxfp4", "mxfp4": "triton_mxfp4", "mxfp8": "triton_mxfp8"}


@pytest.fixture(autouse=True)
def _strict():
    """A named backend that cannot run raises, rather than falling back to ``reference``."""
    gg.configure(strict=True)


def _operands(op, gen, scale_a=1.0, scale_b=1.0):
    """(a, b) of ``op`` in bf16, each scaled (in fp32, before rounding to bf16)."""
    m, g = sum(SPLITS), len(SPLITS)
    shapes = {"fwd": ((m, K), (g, N, K)), "dgrad": ((m, N), (g, N, K)), "wgrad": ((m, N), (m, K))}[op]
    a, b = (torch.randn(*s, generator=gen) for s in shapes)
    return (a * scale_a).to(torch.bfloat16), (b * scale_b).to(torch.bfloat16)


def _out(op, dtype=torch.float32):
    m, g = sum(SPLITS), len(SPLITS)
    return poison(torch.empty({"fwd": (m, N), "dgrad": (m, K), "wgrad": (g, N, K)}[op], dtype=dtype))


def _run(recipe, op, a, b, backend, out):
    return CALLS[op](a, b, SPLITS, recipe=recipe, backend=backend, out=out)


# ---- bf16 subnormals: the interpreter's bf16 -> fp32 conversion mis-decodes them --------


@pytest.mark.parametrize("operand", ["a", "b"])
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
def test_bf16_subnormal_operands_are_multiplied_exactly(op, operand, gen):
    """triton_grouped on bf16 subnormals (x 1e-39): the products are exact in fp32 as on a
    GPU; the interpreter's conversion gave 4.4e-39 for 1e-39 and 0 for 1e-40."""
    a, b = _operands(op, gen, *((1e-39, 1.0) if operand == "a" else (1.0, 1e-39)))
    want = REFS[op](a, b, SPLITS)
    got = _run("bf16", op, a, b, "triton_grouped", _out(op))
    assert rel_error(got, want) < FP32_OUT_TOL


@pytest.mark.parametrize("arch", ["cpu", "gfx950"], ids=["upcast", "dot_scaled"])
@pytest.mark.parametrize("op", ["fwd", "dgrad"])
def test_a16w4_subnormal_activations_match_the_reference(op, arch, gen):
    """a16w4 (bf16 activations, E2M1 weights) on subnormal activations, on both kernel
    paths: the same result as ``reference`` (the interpreter's conversion gave -12 dB)."""
    a, b = _operands(op, gen, 1e-39)
    want = _run("a16w4", op, a, b, "reference", _out(op))
    with emulated(arch):
        got = _run("a16w4", op, a, b, "triton_mxfp4", _out(op))
    assert sqnr_db(got, want) >= MIN_SQNR


# ---- bf16 results: the interpreter's fp32 -> bf16 conversion truncates -------------------


@pytest.mark.parametrize(
    ("recipe", "op", "arch"),
    [
        ("bf16", "fwd", "cpu"),
        ("bf16", "dgrad", "cpu"),
        ("bf16", "wgrad", "cpu"),
        ("bf16", "wgrad_accumulate", "cpu"),
        ("a16w4", "fwd", "cpu"),
        ("a16w4", "dgrad", "gfx950"),
        ("mxfp8", "wgrad", "cpu"),
    ],
)
def test_bf16_results_round_to_nearest_even(recipe, op, arch, gen):
    """A bf16 ``out`` holds the fp32 result rounded to nearest even, as a GPU's conversion
    and ``reference`` give it: the interpreter's truncated (every result rounded toward
    zero, 1e-5 -> 9.95e-6). Compared on the bits, at most one ulp apart (summation order)
    and not biased toward zero."""
    accumulate = op == "wgrad_accumulate"
    op = "wgrad" if accumulate else op
    a, b = _operands(op, gen)
    start = _out(op).normal_(generator=gen).to(torch.bfloat16) if accumulate else None
    want = _out(op)
    if accumulate:
        want.copy_(start)
    if recipe == "bf16":
        want = REFS[op](a, b, SPLITS) + (start.double() if accumulate else 0)
    else:
        _run(recipe, op, a, b, "reference", want)
    out = start.clone() if accumulate else _out(op, torch.bfloat16)
    with emulated(arch):
        kwargs = {"accumulate": True} if accumulate else {}
        got = CALLS[op](a, b, SPLITS, recipe=recipe, backend=BACKENDS[recipe], out=out, **kwargs)
    rounded = want.to(torch.bfloat16)
    ulps = (got.view(torch.int16).int() - rounded.view(torch.int16).int()).abs()
    assert ulps.max() <= 1
    assert (got == rounded).float().mean() > 0.9


# ---- MX decodes at the bottom of the range: scale byte 0, subnormal results -------------


@pytest.mark.parametrize(
    ("recipe", "op", "operand"),
    [
        ("a16w4", "fwd", "b"),
        ("a16w4", "dgrad", "b"),
        ("mxfp8", "fwd", "a"),
        ("mxfp8", "fwd", "b"),
        ("mxfp8", "dgrad", "b"),
        ("mxfp4", "wgrad", "a"),
        ("mxfp8", "wgrad", "b"),
    ],
)
def test_tiny_blocks_decode_exactly(recipe, op, operand, gen):
    """Operands of magnitude 2^-126 take the smallest E8M0 scales (byte 0 is 2^-127, a bf16
    subnormal) and decode to bf16 subnormals: the upcast path (weights decoded in
    registers, activations by the dequantize kernels) gives ``reference``'s result; the
    interpreter's bf16 conversions had it at SQNR 0-12 dB."""
    a, b = _operands(op, gen, *((2.0**-126, 1.0) if operand == "a" else (1.0, 2.0**-126)))
    want = _run(recipe, op, a, b, "reference", _out(op))
    got = _run(recipe, op, a, b, BACKENDS[recipe], _out(op))
    assert sqnr_db(got, want) >= MIN_SQNR


@pytest.mark.parametrize("arch", ["cpu", "sm_90", "gfx950"])
@pytest.mark.parametrize(("fmt", "recipe"), [("e4m3", "mxfp8"), ("e2m1", "mxfp4")])
def test_dgrad_over_an_empty_contraction_with_a_prequantized_weight_is_zero(arch, fmt, recipe):
    """N=0 dgrad with a pre-quantized E4M3 weight reached the sm_90 layout builder, which
    failed viewing the empty codes as int32; the sum over nothing is zeros."""
    dy, w = torch.randn(6, 0), torch.randn(2, 0, 64)
    out = poison(torch.empty(6, 64))
    with emulated(arch):
        got = gg.grouped_gemm_dgrad(
            gg.quantize_mx(dy, fmt), gg.quantize_mx_weight(w, fmt, op="dgrad"), [2, 4], recipe=recipe, out=out
        )
    assert got is out and not got.any()
