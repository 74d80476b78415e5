"""triton_mxfp4: every kernel against the reference backend on the same quantized inputs.

On the CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
when no GPU is visible): tiny shapes, both paths (the Hopper upcast kernel, chosen for the
CPU's arch, and the dot_scaled kernel, chosen under ``emulated("gfx950")``). Outputs are
poisoned with NaN first, so a row a kernel forgets shows up. The GPU tests at the end run
the same checks at realistic sizes (``pytest -m gpu``).
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

import grouped_gemm as gg
from grouped_gemm.backends.triton_mx import TritonMxfp4Backend, decode, launch, layouts, layouts_e4m3
from grouped_gemm.backends.triton_mx.upcast_kernel import _block
from grouped_gemm.device import emulated
from grouped_gemm.errors import BackendRunError, InvalidArgumentError
from grouped_gemm.mx import MXTensor, quantize_mx, quantize_mx_weight
from grouped_gemm.testing import poison, random_splits, ref_fwd, sqnr_db

NAME = "triton_mxfp4"
MIN_SQNR = 60.0
RECIPES = ("mxfp4", "a8w4", "a16w4")
PATHS = {"upcast": "cpu", "dot_scaled": "gfx950"}
CPU_SPLITS = {
    "unaligned_with_empty": [5, 0, 40, 3],
    "single_group": [37],
    "all_empty": [0, 0, 0],
}

needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or not launch.interpreted(), reason="CPU tests run the kernels in Triton's interpreter"
)


def _operands(op, recipe, m, n, k, groups, gen, device="cpu"):
    """(a, b) for an op: fresh random normal data (bf16 activations for a16w4)."""
    act_dtype = torch.bfloat16 if recipe == "a16w4" else torch.float32
    w = torch.randn(groups, n, k, generator=gen).to(device)
    if op == "fwd":
        return torch.randn(m, k, generator=gen).to(device, act_dtype), w
    if op == "dgrad":
        return torch.randn(m, n, generator=gen).to(device, act_dtype), w
    return torch.randn(m, n, generator=gen).to(device), torch.randn(m, k, generator=gen).to(device)


def _call(op, a, b, splits, recipe, backend, out=None, accumulate=False):
    with gg.use_backends(backend, strict=True):
        if op == "fwd":
            return gg.grouped_gemm(a, b, splits, recipe=recipe, out=out, out_dtype=torch.float32)
        if op == "dgrad":
            return gg.grouped_gemm_dgrad(a, b, splits, recipe=recipe, out=out, out_dtype=torch.float32)
        return gg.grouped_gemm_wgrad(
            a, b, splits, recipe=recipe, out=out, out_dtype=torch.float32, accumulate=accumulate
        )


def _out_shape(op, m, n, k, groups):
    return {"fwd": (m, n), "dgrad": (m, k), "wgrad": (groups, n, k)}[op]


def _check_against_reference(op, recipe, splits, n, k, gen, device="cpu"):
    groups, m = len(splits), sum(splits)
    a, b = _operands(op, recipe, m, n, k, groups, gen, device)
    out = poison(torch.empty(_out_shape(op, m, n, k, groups), device=device))
    got = _call(op, a, b, splits, recipe, NAME, out=out)
    want = _call(op, a, b, splits, recipe, "reference")
    assert got is out
    assert torch.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    if m:
        assert sqnr_db(got, want) >= MIN_SQNR
    else:
        assert torch.equal(got, want)
    assert gg.dispatch_stats()["selected"].get(NAME, 0) >= 1


# ---- interpreter: every kernel, both paths ------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("splits", list(CPU_SPLITS.values()), ids=list(CPU_SPLITS))
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("op", ["fwd", "dgrad"])
def test_fwd_dgrad_match_reference(op, recipe, splits, path, gen):
    with emulated(PATHS[path]):
        _check_against_reference(op, recipe, splits, n=64, k=96, gen=gen)


@needs_interpreter
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.slow
def test_skewed_splits_and_even_contraction(path, gen):
    """Skewed random splits with empty groups, contraction a multiple of both K steps."""
    splits = random_splits(6, 150, empty=2, generator=gen)
    with emulated(PATHS[path]):
        _check_against_reference("fwd", "mxfp4", splits, n=96, k=128, gen=gen)
        _check_against_reference("dgrad", "a16w4", splits, n=128, k=96, gen=gen)


@needs_interpreter
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(
    "splits", [*CPU_SPLITS.values(), [33, 0, 1, 64], [40, 0, 150]], ids=[*CPU_SPLITS, "straddling", "several_steps"]
)
def test_wgrad_matches_reference(splits, path, gen):
    """``several_steps``: a group of 150 tokens (160 padded) starting at token 64 takes three
    64-token contraction steps in the interpreter, the last one partly masked."""
    with emulated(PATHS[path]):
        _check_against_reference("wgrad", "mxfp4", splits, n=64, k=96, gen=gen)


@needs_interpreter
@pytest.mark.parametrize("path", list(PATHS))
def test_a8w4_wgrad_runs_e4m3_by_e4m3(path, gen):
    """a8w4's wgrad multiplies E4M3 gradients by E4M3 activations (no E2M1 operand)."""
    with emulated(PATHS[path]):
        _check_against_reference("wgrad", "a8w4", [20, 0, 45], n=64, k=96, gen=gen)


@needs_interpreter
@pytest.mark.parametrize("path", list(PATHS))
def test_wgrad_accumulates_and_leaves_empty_groups(path, gen):
    splits = [20, 0, 45]
    n, k = 32, 64
    dy, x = _operands("wgrad", "mxfp4", sum(splits), n, k, len(splits), gen)
    main_grad = torch.randn(len(splits), n, k, generator=gen)
    before = main_grad.clone()
    with emulated(PATHS[path]):
        got = _call("wgrad", dy, x, splits, "mxfp4", NAME, out=main_grad, accumulate=True)
        want = _call("wgrad", dy, x, splits, "mxfp4", "reference", out=before.clone(), accumulate=True)
    assert got is main_grad
    assert torch.equal(got[1], before[1]), "an empty group's gradient must stay untouched"
    assert sqnr_db(got - before, want - before) >= MIN_SQNR


@needs_interpreter
@pytest.mark.parametrize("path", list(PATHS))
def test_prequantized_operands_and_layout_cache(path, gen):
    """MXTensor x and w are used as given; the upcast layout is built once per weight
    object and rebuilt after the weight changes in place."""
    splits = [9, 0, 30]
    m, n, k = sum(splits), 64, 64
    x = quantize_mx(torch.randn(m, k, generator=gen), "e4m3")
    w = quantize_mx_weight(torch.randn(3, n, k, generator=gen), "e2m1", op="fwd")
    with emulated(PATHS[path]):
        want = _call("fwd", x, w, splits, "a8w4", "reference")
        first = _call("fwd", x, w, splits, "a8w4", NAME)
        assert sqnr_db(first, want) >= MIN_SQNR
        if path == "upcast":
            cached = layouts.upcast_weight(w)
            assert layouts.upcast_weight(w) is cached
        w.data.copy_(torch.randint(0, 256, w.data.shape, generator=gen, dtype=torch.uint8))
        changed = _call("fwd", x, w, splits, "a8w4", NAME)
        assert sqnr_db(changed, _call("fwd", x, w, splits, "a8w4", "reference")) >= MIN_SQNR
        if path == "upcast":
            assert layouts.upcast_weight(w) is not cached


@needs_interpreter
def test_layout_cache_sees_declared_writes_and_inference_tensors(gen):
    """The Hopper layout of a pre-quantized weight is keyed on its tensors' writes: one
    torch does not count (a ``.data`` write here; a ``torch.distributed`` broadcast into a
    served weight is another) is picked up once ``gg.mark_updated`` declares it, and a
    weight made under ``torch.inference_mode`` (no version counter: its read raised) runs."""
    splits = [9, 0, 30]
    m, n, k = sum(splits), 64, 64
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = quantize_mx_weight(torch.randn(3, n, k, generator=gen), "e2m1", op="fwd")
    with emulated(PATHS["upcast"]):
        first = _call("fwd", x, w, splits, "a16w4", NAME)
        w.data.data.copy_(torch.randint(0, 256, w.data.shape, generator=gen, dtype=torch.uint8))
        assert torch.equal(_call("fwd", x, w, splits, "a16w4", NAME), first)  # undeclared: the old layout
        gg.mark_updated(w)
        want = _call("fwd", x, w, splits, "a16w4", "reference")
        assert sqnr_db(_call("fwd", x, w, splits, "a16w4", NAME), want) >= MIN_SQNR
        with torch.inference_mode():
            wi = quantize_mx_weight(torch.randn(3, n, k, generator=gen), "e2m1", op="fwd")
            got = _call("fwd", x, wi, splits, "a16w4", NAME)
            assert sqnr_db(got, _call("fwd", x, wi, splits, "a16w4", "reference")) >= MIN_SQNR
            wi.data.copy_(torch.randint(0, 256, wi.data.shape, generator=gen, dtype=torch.uint8))
            gg.mark_updated(wi)  # writes to inference tensors are never counted by torch
            got = _call("fwd", x, wi, splits, "a16w4", NAME)
            assert sqnr_db(got, _call("fwd", x, wi, splits, "a16w4", "reference")) >= MIN_SQNR


@needs_interpreter
@pytest.mark.parametrize("path", list(PATHS))
def test_prequantized_dgrad_and_floor_scale_rule(path, gen):
    """dgrad with dy and w passed as MXTensors blocked along N; and high-precision inputs
    quantized with the recipe's scale rule (floor here), like the reference does."""
    splits = [12, 0, 21]
    m, n, k = sum(splits), 64, 96
    dy = quantize_mx(torch.randn(m, n, generator=gen), "e2m1")
    w = quantize_mx_weight(torch.randn(3, n, k, generator=gen), "e2m1", op="dgrad")
    floor = gg.get_recipe("mxfp4").model_copy(update={"scale_rule": "floor"})
    x = torch.randn(m, k, generator=gen)
    w_hp = torch.randn(3, n, k, generator=gen)
    with emulated(PATHS[path]):
        got = _call("dgrad", dy, w, splits, "mxfp4", NAME, out=poison(torch.empty(m, k)))
        assert sqnr_db(got, _call("dgrad", dy, w, splits, "mxfp4", "reference")) >= MIN_SQNR
        got = _call("fwd", x, w_hp, splits, floor, NAME, out=poison(torch.empty(m, n)))
        assert sqnr_db(got, _call("fwd", x, w_hp, splits, floor, "reference")) >= MIN_SQNR


@needs_interpreter
def test_upcast_layout_round_trip(gen):
    """The layout holds the same codes and scales, rearranged: decode it back."""
    for op in ("fwd", "dgrad"):
        w = quantize_mx_weight(torch.randn(2, 64, 160, generator=gen), "e2m1", op=op)
        lay = layouts.build_upcast_weight(w)
        runs = lay.k_padded // 128
        bits = [decode.E2M1_BITS[i % 4][i // 4] for i in range(8)]
        nibbles = torch.stack(
            [sum(((lay.data >> b) & 1) << k for k, b in enumerate(bits[i])) for i in range(8)], -1
        )  # j + 4h
        nibbles = nibbles.reshape(2, lay.rows, runs, 4, 4, 2, 4)  # g, row, run, q, b, h, j
        codes = nibbles.permute(0, 1, 2, 4, 6, 3, 5).reshape(2, lay.rows, -1)[..., : lay.k_red]
        words = lay.scales.transpose(1, 2)
        blocks = torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], dim=-1).reshape(2, lay.rows, -1)
        as_mx = MXTensor(
            data=(codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8),
            scale=blocks[..., : lay.k_red // 32].to(torch.uint8).contiguous(),
            fmt="e2m1",
            axis=2,
            shape=(2, lay.rows, lay.k_red),
        )
        expected = w.dequantize() if op == "fwd" else w.dequantize().transpose(1, 2)
        assert torch.equal(as_mx.dequantize(), expected)


@triton.jit
def _decode_tile(W, stride_w, S, Out, BN: tl.constexpr, PTX: tl.constexpr):
    """Store the upcast kernel's decode of the first 128 contraction elements of BN rows."""
    rn = tl.arange(0, BN)
    run_scales = tl.load(S + rn)
    for b in tl.static_range(4):
        words = tl.load(W + rn[:, None] * stride_w + tl.arange(0, 4)[None, :] * 4 + b)
        values = _block(words, None, run_scales, b, PTX, False, "e2m1")
        tl.store(Out + rn[:, None] * 128 + 32 * b + tl.arange(0, 32)[None, :], values)


def _check_edge_scales(device, ptx, scale_bytes, gen):
    """Edge scale bytes with every code: the kernel's decode equals MXTensor.dequantize bit
    for bit (subnormal, infinite and NaN results included)."""
    n = 256
    codes = torch.randint(0, 256, (1, n, 64), generator=gen, dtype=torch.uint8)
    scale_bytes = torch.tensor(scale_bytes, dtype=torch.uint8)
    scale = scale_bytes[torch.randint(0, len(scale_bytes), (1, n, 4), generator=gen)]
    w = MXTensor(data=codes, scale=scale, fmt="e2m1", axis=2, shape=(1, n, 128)).to(device)
    lay = layouts.build_upcast_weight(w)
    out = torch.empty(n, 128, dtype=torch.bfloat16, device=device)
    _decode_tile[(1,)](lay.data[0], lay.data.stride(1), lay.scales[0, 0], out, BN=n, PTX=ptx)
    want = w.dequantize(torch.bfloat16)[0]
    assert ((out == want) | (torch.isnan(out) & torch.isnan(want))).all()
    assert torch.equal(torch.signbit(out[out == 0]), torch.signbit(want[out == 0]))


@needs_interpreter
def test_edge_scale_bytes_decode_exactly(gen):
    """Bytes 0 and 1 give bf16 subnormals (the multiplier 2^-127 among them), which the
    decode takes and rounds on the bits: Triton's own bf16 conversions get them wrong in
    the interpreter (2^-128 became 0)."""
    _check_edge_scales("cpu", False, [0, 1, 2, 3, 127, 252, 253, 254, 255], gen)


@needs_interpreter
def test_folded_scale_multiply_matches(gen):
    """Cached layouts of weights whose scale bytes are all <= 128 multiply once (the 2^126
    folded into the scale); the result is the same as with two multiplies, and a byte
    above 128 keeps the two."""
    splits = [7, 25]
    x = torch.randn(sum(splits), 128, generator=gen).to(torch.bfloat16)
    w = quantize_mx_weight(torch.randn(2, 64, 128, generator=gen), "e2m1")
    folded, plain = layouts.upcast_weight(w), layouts.build_upcast_weight(w)
    assert folded.small_scales and not plain.small_scales
    sizes = torch.tensor(splits, dtype=torch.int32)
    one = launch.launch_upcast(x, folded, sizes, poison(torch.empty(32, 64)), 2)
    two = launch.launch_upcast(x, plain, sizes, poison(torch.empty(32, 64)), 2)
    assert torch.equal(one, two)
    w.scale[0, 0, 0] = 129
    assert not layouts.upcast_weight(w).small_scales


@needs_interpreter
@pytest.mark.parametrize("run_major", [True, False])
@pytest.mark.parametrize("blocks", [2, 4])
def test_upcast_contraction_steps(blocks, run_major, gen):
    """Both step sizes of the upcast kernel against float64, K = 192: 64-element steps also
    start in the middle of a 128-run, 128-element steps read the layout's zero padding;
    both memory orders of the layout (the kernel reads either through its strides)."""
    splits = [3, 0, 29]
    n, k = 96, 192
    x = torch.randn(sum(splits), k, generator=gen).to(torch.bfloat16)
    w = quantize_mx_weight(torch.randn(3, n, k, generator=gen), "e2m1")
    config = launch.UpcastConfig(bm=16, bn=64, blocks=blocks, warps=4, stages=1, per_sm=1)
    got = launch.launch_upcast(
        x,
        layouts.build_upcast_weight(w, run_major=run_major),
        torch.tensor(splits),
        poison(torch.empty(32, n)),
        3,
        config,
    )
    want = ref_fwd(x, w.dequantize(), splits)
    assert sqnr_db(got, want) >= MIN_SQNR


#: Group sizes around a two-height schedule's boundary (small = 16 rows): empty groups,
#: exactly one small tile, one row over it, several large tiles, one group alone.
HEIGHT_SPLITS = {
    "boundary": [16, 0, 17, 1, 0, 33],
    "skewed": [70, 2, 0, 15, 31, 5],
    "single_group": [17],
    "all_small": [3, 16, 9],
    "tails": [48, 49, 32, 80, 0, 1],  # last tiles with exactly 16 rows left, 17, none, ...
}


def _two_height_weights(fmt, groups, n, k, gen, device="cpu"):
    """(weight MXTensor, its upcast layout) in either weight format."""
    w = quantize_mx_weight(torch.randn(groups, n, k, generator=gen).to(device), fmt)
    if fmt == "e4m3":
        return w, layouts_e4m3.upcast_weight_e4m3(w)
    return w, layouts.upcast_weight(w)


@needs_interpreter
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
@pytest.mark.parametrize("splits", list(HEIGHT_SPLITS.values()), ids=list(HEIGHT_SPLITS))
@pytest.mark.parametrize("bm", [32, 64])
def test_two_height_tiles_match_float64(bm, splits, fmt, gen):
    """Tiles with at most 16 of their group's rows left (small groups, ragged last tiles)
    16 rows high, the others ``bm``: every row written (poisoned output) and equal to
    float64 within the bf16 result's rounding."""
    n, k = 96, 128
    x = torch.randn(sum(splits), k, generator=gen).to(torch.bfloat16)
    w, lay = _two_height_weights(fmt, len(splits), n, k, gen)
    config = launch.UpcastConfig(bm=bm, bn=64, blocks=4, warps=4, stages=1, per_sm=1, small=16)
    out = poison(torch.empty(sum(splits), n))
    got = launch.launch_upcast(x, lay, torch.tensor(splits, dtype=torch.int32), out, len(splits), config)
    assert torch.isfinite(got).all(), "unwritten (NaN-poisoned) rows"
    assert sqnr_db(got, ref_fwd(x, w.dequantize(), splits)) >= MIN_SQNR


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
def test_gpu_two_height_tiles_equal_one_height(fmt, gen):
    """On the GPU the two-height decode tile writes bit for bit what the one-height 32- and
    16-row tiles write (each output element sums the same products in the same order), and
    matches float64."""
    device = torch.device("cuda")
    splits = [*gg.skewed_splits(31, 480), 16, 17, 0]
    n, k = 256, 1024
    x = torch.randn(sum(splits), k, generator=gen).to(device, torch.bfloat16)
    w, lay = _two_height_weights(fmt, len(splits), n, k, gen, device)
    sizes = torch.tensor(splits, device=device, dtype=torch.int32)
    tiles = [
        launch.UpcastConfig(bm=32, bn=128, blocks=4, warps=4, stages=4, per_sm=2, small=16),
        launch.UpcastConfig(bm=32, bn=128, blocks=4, warps=4, stages=3, per_sm=2),
        launch.UpcastConfig(bm=16, bn=128, blocks=4, warps=4, stages=4, per_sm=2),
    ]
    outs = []
    for tile in tiles:
        out = poison(torch.empty(x.shape[0], n, device=device))
        outs.append(launch.launch_upcast(x, lay, sizes, out, len(splits), tile))
    assert torch.isfinite(outs[0]).all()
    assert sqnr_db(outs[0].cpu(), ref_fwd(x.cpu(), w.dequantize().cpu(), splits)) >= MIN_SQNR
    for other in outs[1:]:
        assert torch.equal(outs[0], other)


# ---- eligibility ---------------------------------------------------------------------------


def _reasons(**described):
    decision = gg.explain(**described)
    return decision.candidate(NAME).reasons, decision.selected


@pytest.mark.parametrize("arch", ["sm_90", "sm_100", "gfx950"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_chosen_for_mx_recipes_where_eligible(arch, recipe, monkeypatch):
    monkeypatch.setattr(launch, "interpreted", lambda: False)  # described GPU problems, as on a GPU host
    reasons, selected = _reasons(groups=8, m=4096, n=1024, k=2048, recipe=recipe, device=arch, device_splits=True)
    assert reasons == ()
    assert selected == NAME


@pytest.mark.parametrize(
    ("described", "code"),
    [
        ({"k": 2000}, "align"),
        ({"n": 1000}, "align"),
        ({"groups": 2048}, "groups"),
        ({"device": "gfx942"}, "arch"),
        ({"device": "sm_80"}, "arch"),
        ({"recipe": "mxfp8"}, "recipe"),
        ({"recipe": "bf16"}, "recipe"),
        ({"recipe": "a16w4", "op": "wgrad"}, "recipe"),
        ({"recipe": "a16w4", "dtype": "float32"}, "dtype"),
        ({"weight_list": True}, "layout"),
    ],
)
def test_ineligible_problems_say_why(described, code):
    args = {"groups": 8, "m": 1024, "n": 1024, "k": 2048, "recipe": "mxfp4", "device": "sm_90", **described}
    reasons, selected = _reasons(**args)
    assert code in {r.code for r in reasons}
    assert selected != NAME


def test_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(launch, "interpreted", lambda: False)
    problem = gg.describe_problem(groups=2, m=64, n=64, k=64, recipe="mxfp4", device="cpu")
    assert "missing" in {r.code for r in TritonMxfp4Backend().check(problem)}


@needs_interpreter
def test_weight_blocked_along_the_wrong_axis_is_refused(gen):
    """A weight quantized for dgrad (along N) passed to fwd is a clear error, never a result."""
    x = torch.randn(8, 64, generator=gen)
    w = quantize_mx_weight(torch.randn(2, 64, 64, generator=gen), "e2m1", op="dgrad")
    with pytest.raises((InvalidArgumentError, BackendRunError)) as info:
        _call("fwd", x, w, [3, 5], "mxfp4", NAME)
    assert "axis" in str(info.value)


# ---- GPU: realistic sizes ----------------------------------------------------------------


GPU_SPLITS = {
    "balanced": lambda g, m: gg.balanced_splits(g, m),
    "skewed": lambda g, m: gg.skewed_splits(g, m),
    "decode": lambda g, m: random_splits(g, m, empty=g // 4, generator=torch.Generator().manual_seed(7)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["upcast", "dot_scaled"])
@pytest.mark.parametrize("splits", list(GPU_SPLITS))
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
def test_gpu_matches_reference(op, recipe, splits, path, gen):
    """On the H200 the dot_scaled path runs Triton's own sm_90 emulation of tl.dot_scaled
    (forced by emulating sm_100 on it); the upcast path is the one dispatch picks."""
    if op == "wgrad" and recipe == "a16w4":
        pytest.skip("a16w4's wgrad is bf16 x bf16: torch_grouped_mm runs it (see backend.check)")
    groups, m, n, k = (16, 96, 1024, 1536) if splits == "decode" else (8, 4096, 1536, 1024)
    sizes = GPU_SPLITS[splits](groups, m)
    arch = "sm_100" if path == "dot_scaled" else None
    device = torch.device("cuda")
    if arch:
        with emulated(arch, "cuda"):
            _check_against_reference(op, recipe, sizes, n, k, gen, device)
    else:
        _check_against_reference(op, recipe, sizes, n, k, gen, device)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["mxfp4", "a8w4"])
@pytest.mark.parametrize("device_splits", [True, False])
def test_gpu_bf16_wgrad_through_torch_grouped_mm(recipe, device_splits, gen):
    """A new bf16 wgrad on sm_90 multiplies the bf16 decodes with torch._grouped_mm
    (``launch.vendor_wgrad``): equal to the reference on the same quantized operands, and
    zeros for empty groups (device splits leave zero rows past the last padded group)."""
    sizes = [700, 0, 33, 0, 1291, 5]
    groups, m, n, k = len(sizes), sum(sizes), 512, 768
    dy = torch.randn(m, n, generator=gen).cuda().bfloat16()
    x = torch.randn(m, k, generator=gen).cuda().bfloat16()
    splits = torch.tensor(sizes, device="cuda") if device_splits else sizes
    problem = gg.describe_problem(op="wgrad", m=m, n=n, k=k, groups=groups, recipe=recipe, device="sm_90")
    assert launch.vendor_wgrad_runs(problem)
    got = _call_bf16_wgrad(dy, x, splits, recipe, NAME)
    want = _call_bf16_wgrad(dy, x, splits, recipe, "reference")
    assert got.dtype == torch.bfloat16 and sqnr_db(got, want) >= 40  # two bf16 roundings of one fp32 sum
    assert torch.equal(got[[1, 3]], torch.zeros_like(got[[1, 3]]))


def _call_bf16_wgrad(dy, x, splits, recipe, backend):
    with gg.use_backends(backend, strict=True):
        return gg.grouped_gemm_wgrad(dy, x, splits, recipe=recipe)


@pytest.mark.gpu
@pytest.mark.parametrize("fold", [True, False])
def test_gpu_ptx_decode_equals_portable_decode(fold, gen):
    """The sm_90 PTX decode and the portable one give bit-identical GEMM results, with the
    2^126 folded into the scale or not."""
    device = torch.device("cuda")
    splits = gg.skewed_splits(8, 2048)
    x = torch.randn(sum(splits), 1024, generator=gen).to(device, torch.bfloat16)
    w = quantize_mx_weight(torch.randn(8, 768, 1024, generator=gen).to(device), "e2m1")
    lay = layouts.upcast_weight(w) if fold else layouts.build_upcast_weight(w)
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
    _check_edge_scales("cuda", ptx, [0, 1, 2, 127, 252, 253, 254, 255], gen)


@pytest.mark.gpu
def test_gpu_cuda_graph_with_device_splits(gen):
    """Device splits: no host sync, so the call can be captured and replayed."""
    device = torch.device("cuda")
    g, n, k = 8, 512, 1024
    splits = torch.tensor(gg.skewed_splits(g, 1000), device=device)
    x = torch.randn(1000, k, device=device, dtype=torch.bfloat16)
    w = quantize_mx_weight(torch.randn(g, n, k, device=device), "e2m1")
    out = torch.empty(1000, n, device=device)
    _call("fwd", x, w, splits, "a16w4", NAME, out=out)  # compile and cache the layout first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _call("fwd", x, w, splits, "a16w4", NAME, out=out)
    poison(out)
    graph.replay()
    torch.cuda.synchronize()
    want = _call("fwd", x, w, splits.tolist(), "a16w4", "reference")
    assert sqnr_db(out, want) >= MIN_SQNR
    assert not math.isnan(out.sum().item())


# ---- MX -> bf16 decode (launch.dequantize) ------------------------------------------------


def _random_mx(fmt, axis, shape, pad, scale_bytes, gen, device="cpu"):
    """Random codes (every byte value) and scale bytes drawn from ``scale_bytes``."""
    padded = list(shape)
    padded[axis] += pad
    data_shape, scale_shape = list(padded), list(padded)
    data_shape[axis] //= 2 if fmt == "e2m1" else 1
    scale_shape[axis] //= 32
    data = torch.randint(0, 256, data_shape, generator=gen, dtype=torch.uint8)
    if fmt == "e4m3":
        data = data.view(torch.float8_e4m3fn)
    pick = torch.tensor(scale_bytes, dtype=torch.uint8)
    scale = pick[torch.randint(0, len(pick), scale_shape, generator=gen)]
    return MXTensor(data=data, scale=scale, fmt=fmt, axis=axis, shape=tuple(shape), pad=pad).to(device)


def _assert_bit_identical(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert ((got == want) | (torch.isnan(got) & torch.isnan(want))).all()
    assert torch.equal(torch.signbit(got[got == 0]), torch.signbit(want[got == 0]))


@needs_interpreter
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("shape", [(64, 96), (45, 61)], ids=["even", "ragged_padded"])
def test_dequantize_bit_identical(fmt, axis, shape, gen):
    """Every code (NaNs, -0, odd and even nibbles) under small (bf16-subnormal products),
    normal, large (overflowing) and NaN scale bytes; tiles that do not divide the shape."""
    t = _random_mx(fmt, axis, shape, -shape[axis] % 32, [0, 1, 5, 10, 100, 127, 140, 200, 254, 255], gen)
    want = t.dequantize(torch.bfloat16)
    for tile in (None, launch.DequantTile(br=32, bc=64, warps=4), launch.DequantTile(br=64, bc=32, warps=2)):
        _assert_bit_identical(launch.dequantize(t, tile=tile), want)


@needs_interpreter
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
@pytest.mark.parametrize("axis", [0, 1])
def test_dequantize_scale_byte_zero(fmt, axis, gen):
    """Scale byte 0 is 2^-127: codes whose products stay bf16-normal (|v| >= 2), zeros, NaNs."""
    t = _random_mx(fmt, axis, (64, 64), 0, [0], gen)
    codes = t.data.view(torch.uint8)
    if fmt == "e2m1":
        keep = torch.tensor([0, 4, 5, 6, 7, 8, 12, 13, 14, 15], dtype=torch.uint8)
        low, high = keep[codes.long() % 10], keep[codes.long() // 10 % 10]
        codes.copy_(low | (high << 4))
    else:
        codes.copy_(torch.where((codes & 0x7F) >= 0x40, codes, codes & 0x80))
    _assert_bit_identical(launch.dequantize(t), t.dequantize(torch.bfloat16))


def test_dequantize_refuses_partial_blocks(gen):
    t = _random_mx("e4m3", 1, (32, 64), 0, [127], gen)
    with pytest.raises(InvalidArgumentError):
        launch.dequantize(t, tile=launch.DequantTile(br=32, bc=16, warps=4))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("shape", [(4096, 7168), (4000, 7136)], ids=["aligned", "ragged"])
def test_gpu_dequantize_bit_identical(fmt, axis, shape, gen):
    """Realistic sizes, every code and every scale byte (0 and 1 give bf16 subnormals, 255 NaN,
    large bytes overflow), default and alternative tiles."""
    if shape[axis] % 32:
        shape = (shape[0] // 32 * 32, shape[1]) if axis == 0 else (shape[0], shape[1] // 32 * 32)
    t = _random_mx(fmt, axis, shape, 0, list(range(256)), gen, torch.device("cuda"))
    want = t.dequantize(torch.bfloat16)
    for tile in (None, launch.DequantTile(br=64, bc=128, warps=4), launch.DequantTile(br=32, bc=512, warps=8)):
        _assert_bit_identical(launch.dequantize(t, tile=tile), want)


# ---- quantize and decode in one pass (launch.quantize_decode) ------------------------------


def _activation(shape, dtype, gen, device="cpu", tiny=False):
    """Random normal rows scaled per 32-block by 2^e (e in [-100, 100]; fp16: [-12, 12]), an
    all-zero block, a block holding NaN, one holding Inf, and -0.0 entries. ``tiny`` adds a
    block at fp32-subnormal magnitudes (bf16-subnormal results)."""
    rows, cols = shape
    lo, hi = (-12, 12) if dtype == torch.float16 else (-100, 100)
    blocks = -(-cols // 32)
    exps = torch.randint(lo, hi, (rows, blocks, 1), generator=gen).expand(rows, blocks, 32).reshape(rows, -1)[:, :cols]
    x = (torch.randn(rows, cols, generator=gen, dtype=torch.float64) * torch.exp2(exps.double())).to(dtype)
    x[0, :32] = 0
    x[1, 3] = float("nan")
    x[2, min(40, cols - 1)] = float("inf")
    x[3, 5::7] = -0.0
    if tiny:
        x[4, :32] = torch.randn(32, generator=gen).double().mul(2.0**-140).to(dtype)
    return x.to(device)


@needs_interpreter
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(40, 96), (9, 61)], ids=["even", "ragged"])
def test_quantize_decode_equals_quantize_then_decode(fmt, shape, gen):
    """Bit for bit the two-pass result (torch quantizer, then the MXTensor decode), for every
    input dtype and scale rule, with tiles that do not divide the shape; bf16-subnormal
    results included (fp16 has no such magnitudes)."""
    for dtype, rule in ((torch.bfloat16, "rceil"), (torch.float32, "floor"), (torch.float16, "even")):
        x = _activation(shape, dtype, gen, tiny=dtype != torch.float16)
        want = quantize_mx(x, fmt, axis=-1, scale_rule=rule, pad=True).dequantize(torch.bfloat16)
        for tile in (None, launch.DequantTile(br=16, bc=64, warps=2)):
            _assert_bit_identical(launch.quantize_decode(x, fmt, rule, tile=tile), want)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3", "e5m2"])
def test_gpu_quantize_decode_equals_quantize_then_decode(fmt, gen):
    """A dsv3-sized activation slice, bf16 and fp32, every rule, against the Triton quantizer
    followed by the decode kernel; bf16-subnormal results included."""
    for dtype, rule in ((torch.bfloat16, "rceil"), (torch.float32, "floor"), (torch.bfloat16, "even")):
        x = _activation((4096, 7168), dtype, gen, torch.device("cuda"), tiny=True)
        want = launch.dequantize(quantize_mx(x, fmt, axis=-1, scale_rule=rule))
        _assert_bit_identical(launch.quantize_decode(x, fmt, rule), want)


# ---- the same inside the upcast GEMM (launch_upcast(quantize=...)) -------------------------


def _fused_and_two_pass(x, lay, splits, a_fmt, rule, config, device="cpu"):
    """(one launch quantizing x inside the GEMM, quantize_decode then the GEMM), outputs
    poisoned; the first must not have run the separate pass (else nothing fused was tested)."""
    sizes = torch.tensor(splits, dtype=torch.int32, device=device)
    out = (x.shape[0], lay.rows)
    real = launch.quantize_decode
    two = launch.launch_upcast(
        real(x, a_fmt, rule), lay, sizes, poison(torch.empty(out, device=device)), len(splits), config
    )
    passes = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launch, "quantize_decode", lambda *args, **kw: passes.append(1) or real(*args, **kw))
        one = launch.launch_upcast(
            x, lay, sizes, poison(torch.empty(out, device=device)), len(splits), config, quantize=(a_fmt, rule)
        )
    assert not passes, "the launch quantized in a pass of its own"
    return one, two


@needs_interpreter
@pytest.mark.parametrize(
    ("w_fmt", "a_fmt", "rule", "tma"),
    [
        ("e2m1", "e2m1", "rceil", 1),
        ("e4m3", "e4m3", "floor", 0),
        ("e2m1", "e4m3", "even", 0),
        ("e4m3", "e5m2", "rceil", 1),
    ],
)
def test_upcast_quantizing_activations_equals_two_passes(w_fmt, a_fmt, rule, tma, gen):
    """A decode tile that quantizes its activations writes bit for bit what the separate
    quantize-and-decode pass then the same tile writes: every format pair and rule, ragged
    two-height splits with an empty group, blocks of NaN / Inf / zeros / bf16 subnormals,
    pointer and TMA loads, a ragged contraction (160: a step half past the end)."""
    splits, n, k = [3, 17, 0, 40], 64, 160
    _, lay = _two_height_weights(w_fmt, len(splits), n, k, gen)
    config = launch.UpcastConfig(bm=32, bn=64, blocks=4, warps=4, stages=1, per_sm=1, small=16, tma=tma)
    one, two = _fused_and_two_pass(
        _activation((sum(splits), k), torch.bfloat16, gen, tiny=True), lay, splits, a_fmt, rule, config
    )
    assert torch.isfinite(two[5:]).all(), "unwritten (NaN-poisoned) rows"
    _assert_bit_identical(one, two)


@needs_interpreter
def test_large_upcast_launch_quantizes_activations_in_a_pass_of_its_own(gen, monkeypatch):
    """Given ``quantize``, a tile taller than ``FUSED_MAX_BM``, or a weight of more than
    ``FUSED_MAX_WEIGHT`` elements, runs the quantize-and-decode pass first (the same bits as
    the caller running it); a decode tile on a weight within the limit does not."""
    splits, n, k = [40, 0, 9], 64, 128
    _, lay = _two_height_weights("e4m3", len(splits), n, k, gen)
    x = torch.randn(sum(splits), k, generator=gen).to(torch.bfloat16)
    sizes = torch.tensor(splits)
    passes = []
    real = launch.quantize_decode
    monkeypatch.setattr(launch, "quantize_decode", lambda *args, **kw: passes.append(1) or real(*args, **kw))
    weight = len(splits) * lay.rows * lay.k_red
    try:
        for bm, limit, separate in ((64, weight, True), (32, weight, False), (32, weight - 1, True)):
            monkeypatch.setattr(launch, "FUSED_MAX_WEIGHT", limit)
            launch._upcast_plan.cache_clear()  # plans are looked up: the limits are read when one is made
            config = launch.UpcastConfig(bm=bm, bn=64, blocks=4, warps=4, stages=1, per_sm=1)
            passes.clear()
            one = launch.launch_upcast(x, lay, sizes, poison(torch.empty(x.shape[0], n)), 3, config, ("e4m3", "rceil"))
            assert len(passes) == separate, (bm, limit)
            two = launch.launch_upcast(
                real(x, "e4m3", "rceil"), lay, sizes, poison(torch.empty(x.shape[0], n)), 3, config
            )
            _assert_bit_identical(one, two)
    finally:
        launch._upcast_plan.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize(("w_fmt", "a_fmt"), [("e2m1", "e2m1"), ("e4m3", "e4m3"), ("e2m1", "e4m3"), ("e4m3", "e5m2")])
def test_gpu_upcast_quantizing_activations_equals_two_passes(w_fmt, a_fmt, gen):
    """On the GPU, the default decode tiles (2 and 16 rows a group, skewed, an empty group)
    quantizing their activations write bit for bit what the two-pass route writes, and
    match float64 on the quantized operands (weights within ``FUSED_MAX_WEIGHT``)."""
    device = torch.device("cuda")
    n, k = 256, 1024
    for rows in (2, 16):
        splits = [0, *gg.skewed_splits(31, 31 * rows)]
        w, lay = _two_height_weights(w_fmt, len(splits), n, k, gen, device)
        x = _activation((sum(splits), k), torch.bfloat16, gen, device, tiny=True)
        one, two = _fused_and_two_pass(x, lay, splits, a_fmt, "rceil", None, device)
        _assert_bit_identical(one, two)
        x = torch.randn(sum(splits), k, generator=gen).to(device, torch.bfloat16)
        one, _ = _fused_and_two_pass(x, lay, splits, a_fmt, "rceil", None, device)
        want = ref_fwd(
            quantize_mx(x, a_fmt, axis=-1, scale_rule="rceil").dequantize().cpu(),
            w.dequantize().cpu(),
            splits,
        )
        assert sqnr_db(one.cpu(), want) >= MIN_SQNR


# ---- the same along the tokens per group, rows kept in place (launch.quantize_decode_rows) --


@needs_interpreter
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3", "e5m2"])
@pytest.mark.parametrize("splits", [[40, 0, 7, 33], [0, 0, 65], [5], [0]], ids=["ragged", "empty-first", "G1", "M0"])
def test_quantize_decode_rows_equals_quantize_rows_then_decode(fmt, splits, gen):
    """Bit for bit ``gg.quantize_mx_rows`` decoded with its padding rows dropped, for every
    input dtype and scale rule, with blocks past the last group (device splits size the
    grid by a bound) and a column tile that does not divide the width."""
    m = sum(splits)
    for dtype, rule in ((torch.bfloat16, "rceil"), (torch.float32, "floor"), (torch.float16, "even")):
        x = _activation((m, 61), dtype, gen, tiny=dtype != torch.float16) if m >= 5 else torch.randn(m, 61).to(dtype)
        want = gg.quantize_mx_rows(x, splits, fmt, scale_rule=rule).dequantize(torch.bfloat16)
        starts, padded_starts, padded_rows = gg.mx.padded_row_offsets(splits, m, x.device)
        for tile in (None, launch.DequantTile(br=32, bc=64, warps=2)):
            out = launch.quantize_decode_rows(x, starts, padded_starts, padded_rows + 64, fmt, rule, tile=tile)
            _assert_bit_identical(out, want)


@needs_interpreter
def test_quantize_decode_rows_stays_inside_bad_splits(gen):
    """Device splits are checked by an asynchronous assert, after the kernels are queued:
    starts past the input's rows (or before row 0) must make the kernel touch no row outside
    it (its output is its own, so the stores stay inside too). The input is a view inside a
    larger tensor whose other rows are huge: a read outside it would change the scales."""
    big = torch.full((140, 64), 1e30, dtype=torch.bfloat16)
    big[50:90] = torch.randn(40, 64, generator=gen).to(torch.bfloat16)
    x = big[50:90]
    padded_starts = torch.tensor([0, 32, 96], dtype=torch.int32)
    want = gg.quantize_mx_rows(x, [30, 10], "e4m3").dequantize(torch.bfloat16)
    for starts in ([0, 30, 90], [0, -64, -30]):
        claimed = torch.tensor(starts, dtype=torch.int32)
        got = launch.quantize_decode_rows(x, claimed, padded_starts, 128, "e4m3", "rceil")
        if starts[1] > 0:  # every row of x is some group's: exact. Else rows stay unwritten.
            _assert_bit_identical(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3", "e5m2"])
def test_gpu_quantize_decode_rows_equals_quantize_rows_then_decode(fmt, gen):
    """128 skewed groups (two empty) of a dsv3-wide activation, host and device splits,
    bf16 and fp32, against the Triton row quantizer and the MXTensor decode."""
    splits = gg.skewed_splits(128, 8192)
    splits[5] = splits[77] = 0
    splits[0] += 8192 - sum(splits)
    for dtype, rule in ((torch.bfloat16, "rceil"), (torch.float32, "floor")):
        x = _activation((8192, 7168), dtype, gen, torch.device("cuda"), tiny=True)
        for m_splits in (splits, torch.tensor(splits, device="cuda")):
            want = gg.quantize_mx_rows(x, m_splits, fmt, scale_rule=rule).dequantize(torch.bfloat16)
            starts, padded_starts, padded_rows = gg.mx.padded_row_offsets(m_splits, 8192, x.device)
            _assert_bit_identical(launch.quantize_decode_rows(x, starts, padded_starts, padded_rows, fmt, rule), want)
