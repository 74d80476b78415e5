"""MXTensor operands at the API: formats against the recipe, block axis per op, logical
shapes, recipe inference, and what backends see in the Problem."""

from __future__ import annotations

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm import validation


def _fwd_or_dgrad(*args):
    """(Problem, GroupedInputs) of a validated fwd / dgrad call, as a cache miss builds them."""
    call = validation.fwd_or_dgrad(*args)
    return call.problem(), call.inputs


def _wgrad(*args):
    call = validation.wgrad(*args)
    return call.problem(), call.inputs


@pytest.fixture
def ops(gen):
    x = torch.randn(40, 64, generator=gen)
    w = torch.randn(3, 32, 64, generator=gen)
    dy = torch.randn(40, 32, generator=gen)
    return x, w, dy, [8, 0, 32]


@pytest.mark.parametrize(
    ("x_fmt", "w_fmt", "recipe"),
    [("e4m3", "e4m3", "mxfp8"), ("e2m1", "e2m1", "mxfp4"), ("e4m3", "e2m1", "a8w4"), (None, "e2m1", "a16w4")],
)
def test_fwd_recipe_inferred_from_formats(ops, x_fmt, w_fmt, recipe):
    x, w, _, s = ops
    xa = x if x_fmt is None else gg.quantize_mx(x, x_fmt)
    problem, inputs = _fwd_or_dgrad("fwd", xa, gg.quantize_mx_weight(w, w_fmt), s, None, None, None)
    assert problem.recipe == recipe
    assert problem.a_format == ("float32" if x_fmt is None else f"mx_{x_fmt}")
    assert problem.b_format == f"mx_{w_fmt}"
    assert (problem.m, problem.n, problem.k, problem.groups) == (40, 32, 64, 3)
    assert problem.out_dtype == ("float32" if x_fmt is None else "bfloat16")
    assert inputs.a is xa


def test_dgrad_e5m2_gradients_infer_the_grad_format(ops):
    _, w, dy, s = ops
    problem, _ = _fwd_or_dgrad(
        "dgrad", gg.quantize_mx(dy, "e5m2"), gg.quantize_mx_weight(w, "e4m3", op="dgrad"), s, None, None, None
    )
    assert (problem.recipe, problem.grad_format) == ("mxfp8", "e5m2")


def test_wgrad_formats(ops):
    x, _, dy, _ = ops
    dyq = gg.quantize_mx(dy[:32], "e4m3", axis=0)
    problem, _ = _wgrad(dyq, x[:32], [32, 0, 0], "mxfp8", None, None, False)
    assert (problem.op, problem.a_format, problem.b_format) == ("wgrad", "mx_e4m3", "float32")
    xq = gg.quantize_mx(x[:32], "e4m3", axis=0)
    problem, _ = _wgrad(gg.quantize_mx(dy[:32], "e5m2", axis=0), xq, [0, 32, 0], None, None, None, False)
    assert (problem.recipe, problem.grad_format, problem.b_format) == ("mxfp8", "e5m2", "mx_e4m3")


def test_plain_path_problem_unchanged(ops):
    x, w, _, s = ops
    problem, _ = _fwd_or_dgrad("fwd", x, w, s, None, None, None)
    assert (problem.a_format, problem.b_format, problem.recipe) == ("float32", "float32", "fp32")


@pytest.mark.parametrize(
    ("call", "error", "text"),
    [
        # wrong format for the recipe
        (
            lambda x, w, dy, s: gg.grouped_gemm(gg.quantize_mx(x, "e5m2"), w, s, recipe="mxfp8"),
            gg.DTypeError,
            r"recipe mxfp8 quantizes x \(act_format\) to e4m3, not e5m2",
        ),
        (
            lambda x, w, dy, s: gg.grouped_gemm(x, gg.quantize_mx_weight(w, "e4m3"), s, recipe="a16w4"),
            gg.DTypeError,
            "quantizes w .weight_format. to e2m1, not e4m3",
        ),
        (
            lambda x, w, dy, s: gg.grouped_gemm(
                gg.quantize_mx(x, "e4m3"), gg.quantize_mx_weight(w, "e2m1"), s, recipe="a16w4"
            ),
            gg.DTypeError,
            "keeps x in high precision",
        ),
        (
            lambda x, w, dy, s: gg.grouped_gemm(x, gg.quantize_mx_weight(w, "e2m1"), s, recipe="fp32"),
            gg.DTypeError,
            "recipe fp32 takes plain tensors",
        ),
        # the block axis the op needs
        (
            lambda x, w, dy, s: gg.grouped_gemm(x, gg.quantize_mx_weight(w, "e2m1", op="dgrad"), s),
            gg.ShapeError,
            r"fwd needs w blocked along K \(axis 2\).*axis 1.*transpose are not interchangeable.*op='fwd'",
        ),
        (
            lambda x, w, dy, s: gg.grouped_gemm_dgrad(dy, gg.quantize_mx_weight(w, "e2m1"), s),
            gg.ShapeError,
            r"dgrad needs w blocked along N \(axis 1\)",
        ),
        (
            lambda x, w, dy, s: gg.grouped_gemm(
                gg.quantize_mx(x, "e4m3", axis=0, pad=True), gg.quantize_mx_weight(w, "e2m1"), s
            ),
            gg.ShapeError,
            r"fwd needs x blocked along K \(axis 1\)",
        ),
        (
            lambda x, w, dy, s: gg.grouped_gemm_wgrad(gg.quantize_mx(dy, "e4m3"), x, s, recipe="mxfp8"),
            gg.ShapeError,
            r"wgrad needs dy blocked along M \(axis 0\)",
        ),
        # logical shapes
        (
            lambda x, w, dy, s: gg.grouped_gemm(gg.quantize_mx(x[:, :32], "e4m3"), gg.quantize_mx_weight(w, "e4m3"), s),
            gg.ShapeError,
            r"x=.*K=64 to match w \(3, 32, 64\)",
        ),
        (
            lambda x, w, dy, s: gg.grouped_gemm(x, gg.quantize_mx(w[0], "e2m1"), s),
            gg.ShapeError,
            r"w=.*MXTensor of logical shape \(G, N, K\), got shape \(32, 64\)",
        ),
        (
            lambda x, w, dy, s: gg.grouped_gemm(gg.quantize_mx(x, "e2m1"), gg.quantize_mx_weight(w, "e2m1"), [8, 0]),
            gg.SplitsError,
            "expected 3, got 2",
        ),
        # no recipe can be inferred
        (
            lambda x, w, dy, s: gg.grouped_gemm(gg.quantize_mx(x, "e4m3"), w, s),
            gg.DTypeError,
            r"formats a recipe can be inferred from .*got x: e4m3 and w: plain: pass recipe=",
        ),
        (
            lambda x, w, dy, s: gg.grouped_gemm(gg.quantize_mx(x, "e2m1"), gg.quantize_mx_weight(w, "e4m3"), s),
            gg.DTypeError,
            "got x: e2m1 and w: e4m3",
        ),
        # wgrad blocks may not straddle groups
        (
            lambda x, w, dy, s: gg.grouped_gemm_wgrad(
                gg.quantize_mx(dy, "e4m3", axis=0, pad=True), gg.quantize_mx(x, "e4m3", axis=0, pad=True), s
            ),
            gg.ShapeError,
            "without padding along M",
        ),
        (
            lambda x, w, dy, s: gg.grouped_gemm_wgrad(
                gg.quantize_mx(dy[:32], "e4m3", axis=0), gg.quantize_mx(x[:32], "e4m3", axis=0), [16, 16, 0]
            ),
            gg.SplitsError,
            r"multiples of 32 when dy is an MXTensor.*m_splits\[0\]=16",
        ),
    ],
)
def test_bad_mx_operands(ops, call, error, text):
    x, w, dy, s = ops
    with pytest.raises(error, match=text):
        call(x, w, dy, s)


def test_mx_operand_device_and_out_checks(ops):
    x, w, _, s = ops
    xq, wq = gg.quantize_mx(x, "e4m3"), gg.quantize_mx_weight(w, "e2m1")
    with pytest.raises(gg.ShapeError, match=r"out=.*shape \(M, N\)=\(40, 32\)"):
        gg.grouped_gemm(xq, wq, s, out=torch.empty(40, 64))
    with pytest.raises(gg.DTypeError, match="out_dtype"):
        gg.grouped_gemm(xq, wq, s, out_dtype=torch.int32)
    with pytest.raises(gg.InvalidTypeError, match="accumulate"):
        gg.grouped_gemm_wgrad(gg.quantize_mx(x[:32], "e4m3", axis=0), x[:32], [32, 0, 0], accumulate=1)


def test_recipe_object_with_e5m2_gradients(ops):
    _, w, dy, s = ops
    recipe = gg.get_recipe("mxfp8").model_copy(update={"grad_format": "e5m2"})
    dyq = gg.quantize_mx(dy, "e5m2")
    wq = gg.quantize_mx_weight(w, "e4m3", op="dgrad")
    problem, _ = _fwd_or_dgrad("dgrad", dyq, wq, s, recipe, None, None)
    assert problem.grad_format == "e5m2"
    with pytest.raises(gg.DTypeError, match=r"grad_format\) to e4m3, not e5m2"):
        _fwd_or_dgrad("dgrad", dyq, wq, s, "mxfp8", None, None)


def test_backends_see_the_mx_format_in_eligibility(ops, register):
    x, w, _, s = ops

    class PlainOnly(gg.Backend):
        spec = gg.BackendSpec(name="plain_only_mx_test", ops={"fwd"}, recipes={"a16w4"}, vendors={"cpu"}, priority=99)

        def run(self, problem, inputs):  # pragma: no cover - never eligible here
            raise AssertionError

    register(PlainOnly())
    decision = gg.explain(x, gg.quantize_mx_weight(w, "e2m1"), s)
    text = str(decision)
    assert "pre-quantized MX e2m1 tensor; accepted MX formats: none" in text
    assert decision.selected == "reference"


@pytest.mark.parametrize(
    ("device", "error", "text"),
    [
        (torch.float16, gg.InvalidTypeError, r"^device=torch.float16 is invalid: .*dequantize\(dtype\)"),
        (torch.uint8, gg.InvalidTypeError, r"^device=torch.uint8 is invalid: .*dequantize\(dtype\)"),
        (None, gg.InvalidTypeError, r"^device=None is invalid"),
        ("gpu0", gg.InvalidArgumentError, r"^device='gpu0' is invalid: a torch.device, a name such as"),
        # A GPU this process does not see: torch raised its own RuntimeError / AssertionError.
        (
            f"cuda:{torch.cuda.device_count()}",
            gg.InvalidArgumentError,
            r"^device='cuda:\d+' is invalid: a GPU this process sees",
        ),
    ],
)
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_mxtensor_to_takes_a_device_only(gen, fmt, device, error, text):
    """``q.to(torch.float16)`` converted the codes and failed in the constructor as
    ``data=... is invalid`` (an argument the caller never passed); a bad device name raised
    torch's RuntimeError. Moving to a device still keeps every byte."""
    q = gg.quantize_mx(torch.randn(4, 64, generator=gen), fmt)
    with pytest.raises(error, match=text):
        q.to(device)
    for target in ("cpu", torch.device("cpu"), "meta"):
        moved = q.to(target)
        assert moved.device == torch.device(target) and moved.data.dtype == q.data.dtype
    moved = q.to("cpu")
    assert torch.equal(moved.data.view(torch.uint8), q.data.view(torch.uint8)) and torch.equal(moved.scale, q.scale)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors", "ignore:Sparse CSR tensor support")
@pytest.mark.parametrize(
    "call",
    [
        lambda x: gg.quantize_mx(x.to_sparse(), "e4m3"),
        lambda x: gg.quantize_mx(x.to_sparse_csr(), "e2m1"),
        lambda x: gg.quantize_mx(torch.nested.nested_tensor([x, x[:3]]), "e4m3"),
        lambda x: gg.quantize_mx_rows(x.to_sparse(), [32, 32], "e4m3"),
        lambda x: gg.quantize_mx_weight([x.to_sparse()], "e4m3"),
    ],
)
def test_quantizers_name_a_sparse_or_nested_input(gen, call):
    """A sparse input failed inside torch ("reshape is not implemented for sparse tensors",
    "Could not run 'aten::index.Tensor' with arguments from the 'SparseCPU' backend"), a
    nested one with "NestedTensorImpl doesn't support sizes"."""
    with pytest.raises(gg.InvalidArgumentError, match=r"^[tw]=Tensor.* is invalid: a dense \(strided, not nested\)"):
        call(torch.randn(64, 64, generator=gen))


@pytest.mark.parametrize("part", ["data", "scale"])
def test_mxtensor_names_a_sparse_part(gen, part):
    """A sparse ``data`` or ``scale`` was accepted, then ``dequantize`` (and the kernels)
    failed inside torch ("Could not run 'aten::bitwise_and.Tensor' ... 'SparseCPU'")."""
    q = gg.quantize_mx(torch.randn(4, 64, generator=gen), "e2m1")
    parts = {"data": q.data, "scale": q.scale, "fmt": "e2m1", "axis": 1, "shape": (4, 64)}
    with pytest.raises(gg.InvalidArgumentError, match=rf"^{part}=Tensor.* is invalid: a dense"):
        gg.MXTensor(**{**parts, part: parts[part].to_sparse()})


@pytest.mark.parametrize(
    ("w", "kwargs", "error", "text"),
    [
        (lambda: torch.randn(2, 16, 64, dtype=torch.float64), {}, gg.DTypeError, "dtype torch.float32"),
        (lambda: [torch.randn(16, 64, dtype=torch.float64)], {}, gg.DTypeError, "dtype torch.float32"),
        (lambda: torch.randn(2, 16, 64), {"op": "dgrad"}, gg.ShapeError, "axis 1 length 16 must be a multiple"),
        (lambda: torch.randn(2, 16, 48), {}, gg.ShapeError, "axis 2 length 48 must be a multiple"),
    ],
)
def test_quantize_mx_weight_names_w(w, kwargs, error, text):
    """Its checks ran inside quantize_mx and named ``t=``, an argument quantize_mx_weight has not."""
    with pytest.raises(error, match=rf"^w=Tensor.* is invalid: {text}"):
        gg.quantize_mx_weight(w(), "e4m3", **kwargs)
