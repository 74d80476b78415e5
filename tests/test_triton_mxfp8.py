"""triton_mxfp8: every op against the reference backend on the same quantized operands.

On the CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
when no GPU is visible): tiny shapes, both paths (the Hopper upcast kernel, chosen for the
CPU's arch, and the dot_scaled kernel, chosen under ``emulated("gfx950")``). Outputs are
poisoned with NaN first, so a row a kernel forgets shows up. The GPU tests at the end run
the same checks at realistic sizes, the sm_90 PTX decode and CUDA-graph capture
(``pytest -m gpu``).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import triton
import triton.language as tl

import grouped_gemm as gg
from grouped_gemm.backends.triton_mx import TritonMxfp8Backend, launch, layouts_e4m3
from grouped_gemm.backends.triton_mx.upcast_kernel import _block
from grouped_gemm.backends.triton_mx.weight_prep_kernel import E4M3_HIGH_WORDS, layout_word
from grouped_gemm.device import emulated
from grouped_gemm.errors import BackendRunError, InvalidArgumentError
from grouped_gemm.mx import MXTensor, quantize_mx, quantize_mx_weight
from grouped_gemm.testing import poison, random_splits, ref_fwd, sqnr_db

NAME = "triton_mxfp8"
MIN_SQNR = 60.0
PATHS = {"upcast": "cpu", "dot_scaled": "gfx950"}
CPU_SPLITS = {
    "unaligned_with_empty": [5, 0, 40, 3],
    "single_group": [37],
    "all_empty": [0, 0, 0],
}
E5M2_GRADS = gg.get_recipe("mxfp8").model_copy(update={"grad_format": "e5m2"})

needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or not launch.interpreted(), reason="CPU tests run the kernels in Triton's interpreter"
)


def _operands(op, m, n, k, groups, gen, device="cpu"):
    """(a, b) for an op: fresh random normal fp32 data."""
    w = torch.randn(groups, n, k, generator=gen).to(device)
    if op == "fwd":
        return torch.randn(m, k, generator=gen).to(device), w
    if op == "dgrad":
        return torch.randn(m, n, generator=gen).to(device), w
    return torch.randn(m, n, generator=gen).to(device), torch.randn(m, k, generator=gen).to(device)


def _call(op, a, b, splits, recipe, backend, out=None, accumulate=False, out_dtype=torch.float32):
    with gg.use_backends(backend, strict=True):
        if op == "fwd":
            return gg.grouped_gemm(a, b, splits, recipe=recipe, out=out, out_dtype=out_dtype)
        if op == "dgrad":
            return gg.grouped_gemm_dgrad(a, b, splits, recipe=recipe, out=out, out_dtype=out_dtype)
        return gg.grouped_gemm_wgrad(a, b, splits, recipe=recipe, out=out, out_dtype=out_dtype, accumulate=accumulate)


def _out_shape(op, m, n, k, groups):
    return {"fwd": (m, n), "dgrad": (m, k), "wgrad": (groups, n, k)}[op]


def _check_against_reference(op, splits, n, k, gen, recipe="mxfp8", device="cpu", out_dtype=torch.float32):
    """The backend's output, written into a NaN-poisoned buffer, against the reference
    backend's on the same inputs (both quantize them with the same function and rule)."""
    groups, m = len(splits), sum(splits)
    a, b = _operands(op, m, n, k, groups, gen, device)
    out = poison(torch.empty(_out_shape(op, m, n, k, groups), device=device, dtype=out_dtype))
    got = _call(op, a, b, splits, recipe, NAME, out=out, out_dtype=out_dtype)
    want = _call(op, a, b, splits, recipe, "reference")
    assert got is out
    assert torch.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    if not m:
        assert torch.equal(got.float(), want)
    elif out_dtype == torch.float32:
        assert sqnr_db(got, want) >= MIN_SQNR
    else:
        # Rounded once from the fp32 accumulator (to nearest: ``decode.narrow`` in the
        # interpreter): within one ulp of the fp32 result, the fp32 summation order
        # included. (bf16 itself allows no 60 dB.)
        ulp = 2.0 ** -(7 if out_dtype == torch.bfloat16 else 10)
        assert ((got.float() - want).abs() <= want.abs() * ulp + 1e-5 * want.abs().max()).all()
    assert gg.dispatch_stats()["selected"].get(NAME, 0) >= 1


# ---- interpreter: every op, both paths ----------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("splits", list(CPU_SPLITS.values()), ids=list(CPU_SPLITS))
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
def test_ops_match_reference(op, splits, path, gen):
    with emulated(PATHS[path]):
        _check_against_reference(op, splits, n=64, k=96, gen=gen)


@needs_interpreter
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("rule", ["floor", "even"])
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
def test_scale_rules(op, rule, path, gen):
    """High-precision inputs are quantized with the recipe's scale rule, as the reference
    does (rceil, the default, runs in every other test)."""
    recipe = gg.get_recipe("mxfp8").model_copy(update={"scale_rule": rule})
    with emulated(PATHS[path]):
        _check_against_reference(op, [17, 0, 30], n=64, k=64, gen=gen, recipe=recipe)


@needs_interpreter
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.slow
def test_skewed_splits_and_even_contraction(path, gen):
    """Skewed random splits with empty groups; contractions that are and are not multiples
    of the 128-element K step."""
    splits = random_splits(6, 150, empty=2, generator=gen)
    with emulated(PATHS[path]):
        _check_against_reference("fwd", splits, n=96, k=128, gen=gen)
        _check_against_reference("dgrad", splits, n=160, k=64, gen=gen)


@needs_interpreter
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("op", ["dgrad", "wgrad"])
def test_e5m2_gradients(op, path, gen):
    """grad_format e5m2 through a Recipe copy: dy is E5M2 (its own decode / dot_scaled format)."""
    with emulated(PATHS[path]):
        _check_against_reference(op, [9, 0, 33, 2], n=64, k=64, gen=gen, recipe=E5M2_GRADS)


@needs_interpreter
@pytest.mark.parametrize("path", list(PATHS))
def test_dgrad_with_unquantized_gradients(path, gen):
    """grad_format None: bf16 dy multiplies the E4M3 weight as it is (exact in bf16)."""
    recipe = gg.get_recipe("mxfp8").model_copy(update={"grad_format": None})
    splits = [14, 0, 19]
    dy = torch.randn(33, 64, generator=gen).to(torch.bfloat16)
    w = torch.randn(3, 64, 96, generator=gen)
    with emulated(PATHS[path]):
        got = _call("dgrad", dy, w, splits, recipe, NAME, out=poison(torch.empty(33, 96)))
    assert sqnr_db(got, _call("dgrad", dy, w, splits, recipe, "reference")) >= MIN_SQNR


@needs_interpreter
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_outputs(out_dtype, gen):
    for op in ("fwd", "wgrad"):
        _check_against_reference(op, [20, 0, 13], n=64, k=64, gen=gen, out_dtype=out_dtype)


@needs_interpreter
@pytest.mark.parametrize("path", list(PATHS))
def test_wgrad_accumulates_and_leaves_empty_groups(path, gen):
    splits = [20, 0, 45]
    n, k = 32, 64
    dy, x = _operands("wgrad", sum(splits), n, k, len(splits), gen)
    main_grad = torch.randn(len(splits), n, k, generator=gen)
    before = main_grad.clone()
    with emulated(PATHS[path]):
        got = _call("wgrad", dy, x, splits, "mxfp8", NAME, out=main_grad, accumulate=True)
        want = _call("wgrad", dy, x, splits, "mxfp8", "reference", out=before.clone(), accumulate=True)
    assert got is main_grad
    assert torch.equal(got[1], before[1]), "an empty group's gradient must stay untouched"
    assert sqnr_db(got - before, want - before) >= MIN_SQNR


@needs_interpreter
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
def test_device_splits_tensor(op, path, gen):
    """Splits passed as a tensor (the device-splits form) give the same result as a list."""
    splits = [11, 0, 36]
    n, k = 64, 64
    a, b = _operands(op, sum(splits), n, k, 3, gen)
    with emulated(PATHS[path]):
        got = _call(op, a, b, torch.tensor(splits), "mxfp8", NAME, out=poison(torch.empty(_out_shape(op, 47, n, k, 3))))
        want = _call(op, a, b, splits, "mxfp8", "reference")
    assert sqnr_db(got, want) >= MIN_SQNR


@needs_interpreter
@pytest.mark.parametrize("path", list(PATHS))
def test_prequantized_operands_and_layout_cache(path, gen):
    """MXTensor x / dy and w are used as given (the same quantized operands reach both
    backends); the upcast layout is built once per weight object and rebuilt after the
    weight changes in place."""
    splits = [9, 0, 30]
    m, n, k = sum(splits), 64, 96
    x = quantize_mx(torch.randn(m, k, generator=gen), "e4m3")
    w = quantize_mx_weight(torch.randn(3, n, k, generator=gen), "e4m3", op="fwd")
    dy = quantize_mx(torch.randn(m, n, generator=gen), "e4m3")
    w_dgrad = quantize_mx_weight(torch.randn(3, n, k, generator=gen), "e4m3", op="dgrad")
    with emulated(PATHS[path]):
        got = _call("dgrad", dy, w_dgrad, splits, "mxfp8", NAME, out=poison(torch.empty(m, k)))
        assert sqnr_db(got, _call("dgrad", dy, w_dgrad, splits, "mxfp8", "reference")) >= MIN_SQNR
        first = _call("fwd", x, w, splits, "mxfp8", NAME, out=poison(torch.empty(m, n)))
        assert sqnr_db(first, _call("fwd", x, w, splits, "mxfp8", "reference")) >= MIN_SQNR
        if path == "upcast":
            cached = layouts_e4m3.upcast_weight_e4m3(w)
            assert cached.small_scales and layouts_e4m3.upcast_weight_e4m3(w) is cached
        w.data.copy_((torch.randn(w.data.shape, generator=gen) * 100).to(torch.float8_e4m3fn))
        changed = _call("fwd", x, w, splits, "mxfp8", NAME)
        assert sqnr_db(changed, _call("fwd", x, w, splits, "mxfp8", "reference")) >= MIN_SQNR
        if path == "upcast":
            assert layouts_e4m3.upcast_weight_e4m3(w) is not cached


@needs_interpreter
@pytest.mark.parametrize("path", list(PATHS))
def test_nan_codes_give_nan_columns_like_the_reference(path, gen):
    """An E4M3 NaN code in the weight makes its output column NaN, as in the reference (the
    upcast layout marks its block with the NaN scale); other columns stay exact."""
    splits = [7, 0, 12]
    x = quantize_mx(torch.randn(19, 64, generator=gen), "e4m3")
    w = quantize_mx_weight(torch.randn(3, 32, 64, generator=gen), "e4m3")
    w.data.view(torch.uint8)[2, 5, 40] = 0x7F
    w.data.view(torch.uint8)[0, 9, 3] = 0xFF
    with emulated(PATHS[path]):
        got = _call("fwd", x, w, splits, "mxfp8", NAME, out=poison(torch.empty(19, 32)))
    want = _call("fwd", x, w, splits, "mxfp8", "reference")
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.isnan(got[7:, 5]).all() and torch.isnan(got[:7, 9]).all()
    finite = ~torch.isnan(want)
    assert sqnr_db(got[finite], want[finite]) >= MIN_SQNR


@needs_interpreter
@pytest.mark.parametrize("op", ["fwd", "dgrad"])
def test_upcast_layout_round_trip(op, gen):
    """The layout holds the same codes and scales, rearranged: decode it back."""
    w = quantize_mx_weight(torch.randn(2, 64, 160, generator=gen), "e4m3", op=op)
    lay = layouts_e4m3.build_upcast_weight_e4m3(w)
    runs = lay.k_padded // 128
    data = lay.data.contiguous().view(torch.uint8)  # g, row, run, word (j // 2, q, b), byte (j % 2, h)
    codes = data.reshape(2, lay.rows, runs, 2, 4, 4, 2, 2)  # g, row, run, j // 2, q, b, j % 2, h
    codes = codes.permute(0, 1, 2, 5, 3, 6, 4, 7).reshape(2, lay.rows, -1)[..., : lay.k_red]
    assert [layouts_e4m3.word_index(q, b, high) for high in range(2) for q in range(4) for b in range(4)] == list(
        range(32)
    )
    words = lay.scales.transpose(1, 2)
    blocks = torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], dim=-1).reshape(2, lay.rows, -1)
    as_mx = MXTensor(
        data=codes.contiguous().view(torch.float8_e4m3fn),
        scale=blocks[..., : lay.k_red // 32].to(torch.uint8).contiguous(),
        fmt="e4m3",
        axis=2,
        shape=(2, lay.rows, lay.k_red),
    )
    expected = w.dequantize() if op == "fwd" else w.dequantize().transpose(1, 2)
    assert torch.equal(as_mx.dequantize(), expected)


@triton.jit
def _decode_tile(W, stride_w, S, Out, BN: tl.constexpr, PTX: tl.constexpr, FOLD: tl.constexpr):
    """Store the upcast kernel's E4M3 decode of the first 128 contraction elements of BN rows."""
    rn = tl.arange(0, BN)
    run_scales = tl.load(S + rn)
    for b in tl.static_range(4):
        words = W + rn[:, None] * stride_w + layout_word(tl.arange(0, 4)[None, :], b)
        values = _block(tl.load(words), tl.load(words + E4M3_HIGH_WORDS), run_scales, b, PTX, FOLD, "e4m3")
        tl.store(Out + rn[:, None] * 128 + 32 * b + tl.arange(0, 32)[None, :], values)


def _check_edge_scales(device, ptx, scale_bytes, gen, fold=False, codes=None):
    """Edge scale bytes with every non-NaN code: the kernel's decode equals
    MXTensor.dequantize bit for bit (subnormal, infinite and NaN results, -0 included)."""
    n = 256
    if codes is None:
        codes = torch.randint(0, 256, (1, n, 128), generator=gen, dtype=torch.uint8)
        codes[0, 0, :] = torch.arange(128, dtype=torch.uint8) * 2  # every code once: even ones...
        codes[0, 1, :] = codes[0, 0, :] | 1  # ...and odd ones
        codes[(codes & 0x7F) == 0x7F] &= 0xFE  # NaN codes: see test_nan_codes_give_nan_columns...
    scale_bytes = torch.tensor(scale_bytes, dtype=torch.uint8)
    scale = scale_bytes[torch.randint(0, len(scale_bytes), (1, n, 4), generator=gen)]
    w = MXTensor(data=codes.view(torch.float8_e4m3fn), scale=scale, fmt="e4m3", axis=2, shape=(1, n, 128)).to(device)
    lay = layouts_e4m3.build_upcast_weight_e4m3(w, check_scales=fold)
    assert lay.small_scales == fold
    out = torch.empty(n, 128, dtype=torch.bfloat16, device=device)
    _decode_tile[(1,)](lay.data[0], lay.data.stride(1), lay.scales[0, 0], out, BN=n, PTX=ptx, FOLD=fold)
    want = w.dequantize(torch.bfloat16)[0]
    assert ((out == want) | (torch.isnan(out) & torch.isnan(want))).all()
    assert torch.equal(torch.signbit(out[out == 0]), torch.signbit(want[out == 0]))


@needs_interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # large bytes overflow to inf
def test_edge_scale_bytes_decode_exactly(gen):
    """Scale bytes 0-9 make bf16 subnormals of small codes, which the decode rounds on the
    bits (Triton's own fp32 -> bf16 conversion gets them wrong in the interpreter)."""
    _check_edge_scales("cpu", False, [0, 1, 5, 9, 10, 100, 127, 134, 200, 252, 253, 254, 255], gen)
    _check_edge_scales("cpu", False, [10, 60, 127, 134], gen, fold=True)


@needs_interpreter
def test_folded_scale_multiply_matches(gen):
    """Cached layouts of weights whose scale bytes are all <= 134 multiply once (the 2^120
    folded into the scale); the GEMM is the same as with two multiplies, and a byte above
    134 keeps the two."""
    splits = [7, 25]
    x = torch.randn(sum(splits), 128, generator=gen).to(torch.bfloat16)
    w = quantize_mx_weight(torch.randn(2, 64, 128, generator=gen), "e4m3")
    folded, plain = layouts_e4m3.upcast_weight_e4m3(w), layouts_e4m3.build_upcast_weight_e4m3(w)
    assert folded.small_scales and not plain.small_scales
    sizes = torch.tensor(splits, dtype=torch.int32)
    one = launch.launch_upcast(x, folded, sizes, poison(torch.empty(32, 64)), 2)
    two = launch.launch_upcast(x, plain, sizes, poison(torch.empty(32, 64)), 2)
    assert torch.equal(one, two)
    assert sqnr_db(one, ref_fwd(x, w.dequantize(), splits)) >= MIN_SQNR
    w.scale[0, 0, 0] = 135
    assert not layouts_e4m3.upcast_weight_e4m3(w).small_scales


@needs_interpreter
@pytest.mark.parametrize("warps", [4, 8])
def test_upcast_contraction_steps(warps, gen):
    """The upcast kernel reads E4M3 words four blocks a step, 4 or 8 warps, against float64,
    K = 192: the second 128-run half zero padding."""
    splits = [3, 0, 29]
    n, k = 96, 192
    x = torch.randn(sum(splits), k, generator=gen).to(torch.bfloat16)
    w = quantize_mx_weight(torch.randn(3, n, k, generator=gen), "e4m3")
    config = launch.UpcastConfig(bm=16, bn=128, blocks=4, warps=warps, stages=1, per_sm=1)
    lay = layouts_e4m3.build_upcast_weight_e4m3(w)
    got = launch.launch_upcast(x, lay, torch.tensor(splits), poison(torch.empty(32, n)), 3, config)
    assert sqnr_db(got, ref_fwd(x, w.dequantize(), splits)) >= MIN_SQNR


def test_upcast_refuses_two_block_steps_on_e4m3(gen):
    """A two-block config (an E2M1 tile, or a caller's) is refused for E4M3 by name, before
    any launch; autotuning never offers one."""
    w = quantize_mx_weight(torch.randn(2, 128, 128, generator=gen), "e4m3")
    config = launch.UpcastConfig(bm=16, bn=128, blocks=2, warps=4, stages=1, per_sm=1)
    x = torch.randn(8, 128, generator=gen).to(torch.bfloat16)
    with pytest.raises(gg.InvalidArgumentError, match="blocks=4 for E4M3"):
        lay = layouts_e4m3.build_upcast_weight_e4m3(w)
        launch.launch_upcast(x, lay, torch.tensor([4, 4]), torch.empty(8, 128), 2, config)
    for m, groups in ((16, 8), (512, 8), (2048, 8), (8192, 8)):
        assert {c.blocks for c in launch.upcast_configs(m, groups, "e4m3")} == {4}


# ---- eligibility ---------------------------------------------------------------------------


def _problem(op, arch, **described):
    """A described problem (built as a real call builds it)."""
    args = {"groups": 8, "m": 4096, "n": 1024, "k": 2048, "recipe": "mxfp8", "device_splits": True, **described}
    return gg.describe_problem(op=op, device=arch, **args)


@pytest.mark.parametrize("arch", ["sm_90", "sm_100", "gfx950"])
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
def test_eligible_on_upcast_and_scaled_mma_chips(op, arch, monkeypatch):
    monkeypatch.setattr(launch, "interpreted", lambda: False)  # described GPU problems, as on a GPU host
    assert TritonMxfp8Backend().check(_problem(op, arch)) == []
    assert TritonMxfp8Backend().check(_problem(op, arch, accumulate=op == "wgrad")) == []


@pytest.mark.parametrize("arch", ["sm_90", "sm_100", "gfx950"])
def test_explain_selects_it_for_mxfp8(arch, monkeypatch):
    monkeypatch.setattr(launch, "interpreted", lambda: False)
    decision = gg.explain(groups=8, m=4096, n=1024, k=2048, recipe="mxfp8", device=arch, device_splits=True)
    assert decision.candidate(NAME).reasons == ()
    assert decision.selected == NAME


@needs_interpreter
@pytest.mark.parametrize("arch", ["sm_90", "sm_100", "gfx950"])
@pytest.mark.parametrize("op", ["dgrad", "wgrad"])
def test_explain_with_tensors_selects_it(op, arch, gen):
    """Through real (CPU, interpreted) operands, emulated as the chip."""
    a, b = _operands(op, 64, 64, 64, 2, gen)
    with emulated(arch):
        decision = gg.explain(a, b, [30, 34], op=op, recipe="mxfp8")
    assert decision.selected == NAME


@pytest.mark.parametrize(
    ("op", "described", "code"),
    [
        ("fwd", {"k": 2000}, "align"),
        ("dgrad", {"n": 1000}, "align"),
        ("fwd", {"groups": 2048}, "groups"),
        ("fwd", {"device": "gfx942"}, "arch"),
        ("fwd", {"device": "sm_80"}, "arch"),
        ("fwd", {"recipe": "mxfp4"}, "recipe"),
        ("fwd", {"recipe": "bf16"}, "recipe"),
        ("wgrad", {"weight_list": True}, "layout"),
    ],
)
def test_ineligible_problems_say_why(op, described, code):
    args = {"groups": 8, "m": 1024, "n": 1024, "k": 2048, "recipe": "mxfp8", "device": "sm_90", **described}
    decision = gg.explain(op=op, **args)
    assert code in {r.code for r in decision.candidate(NAME).reasons}
    assert decision.selected != NAME


@pytest.mark.parametrize(
    ("op", "change", "code"),
    [
        ("dgrad", {"grad_format": "e2m1"}, "recipe"),
        ("wgrad", {"grad_format": None}, "recipe"),
        ("dgrad", {"grad_format": None, "a_format": "float32"}, "dtype"),
        ("fwd", {"b_format": "mx_e2m1"}, "dtype"),
        ("fwd", {"a_format": "mx_e5m2"}, "dtype"),
        ("dgrad", {"a_format": "mx_e4m3", "grad_format": "e5m2"}, "dtype"),
        ("wgrad", {"a_format": "mx_e4m3"}, "layout"),
        ("fwd", {"placement": "cpu"}, "missing"),
    ],
)
def test_check_reasons(op, change, code, monkeypatch):
    monkeypatch.setattr(launch, "interpreted", lambda: False)
    problem = dataclasses.replace(_problem(op, "sm_90"), **change)
    assert code in {r.code for r in TritonMxfp8Backend().check(problem)}


@needs_interpreter
def test_interpreter_refuses_gpu_placement():
    problem = dataclasses.replace(_problem("fwd", "sm_90"), placement="cuda")
    assert "missing" in {r.code for r in TritonMxfp8Backend().check(problem)}


@needs_interpreter
@pytest.mark.parametrize(
    ("w_fmt", "op", "axis_op", "match"),
    [("e4m3", "fwd", "dgrad", "axis"), ("e2m1", "fwd", "fwd", "e4m3")],
)
def test_wrong_weight_is_refused(w_fmt, op, axis_op, match, gen):
    """A weight quantized along the wrong axis, or in the wrong format, is a clear error
    naming what is wanted, never a result."""
    x = torch.randn(8, 64, generator=gen)
    w = quantize_mx_weight(torch.randn(2, 64, 64, generator=gen), w_fmt, op=axis_op)
    with pytest.raises((InvalidArgumentError, BackendRunError, gg.errors.GroupedGemmError)) as info:
        _call(op, x, w, [3, 5], "mxfp8", NAME)
    assert match in str(info.value)


# ---- GPU: realistic sizes ----------------------------------------------------------------


GPU_SPLITS = {
    "balanced": lambda g, m: gg.balanced_splits(g, m),
    "skewed": lambda g, m: gg.skewed_splits(g, m),
    "decode": lambda g, m: random_splits(g, m, empty=g // 4, generator=torch.Generator().manual_seed(7)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["upcast", "dot_scaled"])
@pytest.mark.parametrize("splits", list(GPU_SPLITS))
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
def test_gpu_matches_reference(op, splits, path, gen):
    """On the H200 the dot_scaled path runs Triton's own sm_90 emulation of tl.dot_scaled
    (forced by emulating sm_100 on it); the upcast path is the one dispatch picks."""
    groups, m, n, k = (16, 96, 1024, 1536) if splits == "decode" else (8, 4096, 1536, 1024)
    sizes = GPU_SPLITS[splits](groups, m)
    device = torch.device("cuda")
    if path == "dot_scaled":
        with emulated("sm_100", "cuda"):
            _check_against_reference(op, sizes, n, k, gen, device=device)
    else:
        _check_against_reference(op, sizes, n, k, gen, device=device)
        _check_against_reference(op, sizes, n, k, gen, recipe=E5M2_GRADS, device=device, out_dtype=torch.bfloat16)


@pytest.mark.gpu
def test_gpu_every_upcast_candidate_matches_reference(gen):
    """Every tuning candidate of the E4M3 upcast kernel at 4 and 256 rows per group (4 and 8
    warps) against float64, skewed splits with an empty group."""
    device = torch.device("cuda")
    groups, n, k = 6, 384, 640
    w = quantize_mx_weight(torch.randn(groups, n, k, generator=gen).to(device), "e4m3")
    lay = layouts_e4m3.build_upcast_weight_e4m3(w)
    warps = set()
    for mean_rows in (4, 256):
        splits = [0, *gg.skewed_splits(groups - 1, mean_rows * groups)]
        x = torch.randn(sum(splits), k, generator=gen).to(device, torch.bfloat16)
        want = ref_fwd(x.cpu(), w.dequantize().cpu(), splits)
        sizes = torch.tensor(splits, device=device)
        for config in launch.upcast_configs(sum(splits), groups, "e4m3"):
            warps.add(config.warps)
            out = poison(torch.empty(x.shape[0], n, device=device))
            got = launch.launch_upcast(x, lay, sizes, out, groups, config)
            assert sqnr_db(got.cpu(), want) >= MIN_SQNR, config
    assert warps == {4, 8}


@pytest.mark.gpu
@pytest.mark.parametrize("fold", [True, False])
def test_gpu_ptx_decode_equals_portable_decode(fold, gen):
    """The sm_90 PTX decode and the portable one give bit-identical GEMM results, with the
    2^120 folded into the scale or not."""
    device = torch.device("cuda")
    splits = gg.skewed_splits(8, 2048)
    x = torch.randn(sum(splits), 1024, generator=gen).to(device, torch.bfloat16)
    w = quantize_mx_weight(torch.randn(8, 768, 1024, generator=gen).to(device), "e4m3")
    lay = layouts_e4m3.upcast_weight_e4m3(w) if fold else layouts_e4m3.build_upcast_weight_e4m3(w)
    assert lay.small_scales == fold
    sizes = torch.tensor(splits, device=device)
    fast = launch.launch_upcast(x, lay, sizes, poison(torch.empty(x.shape[0], 768, device=device)), 8)
    orig = launch.ptx_decode
    try:
        launch.ptx_decode = lambda _device: False
        slow = launch.launch_upcast(x, lay, sizes, poison(torch.empty(x.shape[0], 768, device=device)), 8)
    finally:
        launch.ptx_decode = orig
    assert torch.equal(fast, slow)


@pytest.mark.gpu
@pytest.mark.parametrize("ptx", [True, False])
def test_gpu_edge_scales_exact(ptx, gen):
    """Every scale byte (0 and 1 give bf16 subnormals, large ones overflow, 255 NaN) with
    every code, unfolded and folded (bytes <= 134)."""
    _check_edge_scales("cuda", ptx, list(range(256)), gen)
    _check_edge_scales("cuda", ptx, list(range(135)), gen, fold=True)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
def test_gpu_cuda_graph_with_device_splits(op, gen):
    """Device splits: no host sync, so each op can be captured and replayed (wgrad
    accumulating into an fp32 main_grad, its quantization inside the graph)."""
    device = torch.device("cuda")
    g, n, k, m = 8, 512, 1024, 1000
    splits = torch.tensor(gg.skewed_splits(g, m), device=device)
    a, b = _operands(op, m, n, k, g, gen, device)
    if op != "wgrad":
        b = quantize_mx_weight(b, "e4m3", op=op)  # a fixed weight: its layout is cached before capture
    out = torch.zeros(_out_shape(op, m, n, k, g), device=device)
    accumulate = op == "wgrad"
    _call(op, a, b, splits, "mxfp8", NAME, out=out, accumulate=accumulate)  # compile and cache first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _call(op, a, b, splits, "mxfp8", NAME, out=out, accumulate=accumulate)
    if accumulate:
        out.zero_()
    else:
        poison(out)
    graph.replay()
    torch.cuda.synchronize()
    assert not math.isnan(out.sum().item())
    assert sqnr_db(out, _call(op, a, b, splits.tolist(), "mxfp8", "reference")) >= MIN_SQNR
