"""hip_mxfp8 on a GPU (``pytest -m gpu tests/test_hip_mxfp8.py``): builds the extension
first (into ``$GROUPED_GEMM_CACHE_DIR``), then checks every op against ``reference`` on the
same quantized operands. Both backends quantize with the same quantizer, so the only
difference is the product: SQNR >= 60 dB against the reference's fp32 result.

Skipped without a GPU; the build-failure path, cache and eligibility are tested on any
machine in tests/test_hip_mxfp8_build.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm.backends.hip_mxfp8 import build
from grouped_gemm.backends.hip_mxfp8.backend import HipMxfp8Backend
from grouped_gemm.mx import quantize_mx, quantize_mx_rows, quantize_mx_weight
from grouped_gemm.testing import poison, random_splits, sqnr_db

pytestmark = pytest.mark.gpu
NAME = "hip_mxfp8"
MIN_SQNR = 60.0
DEVICE = torch.device("cuda")


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    """Build once for the module; a failed build fails here with its log."""
    reason = HipMxfp8Backend().build()
    assert reason is None, f"{reason}\n" + "".join(r.log.read_text() for r in build.all_results() if not r.ok)


def _recipe(rule: str) -> gg.Recipe:
    return gg.get_recipe("mxfp8").model_copy(update={"scale_rule": rule})


def _call(op, a, b, splits, recipe, backend, **kw):
    fn = {"fwd": gg.grouped_gemm, "dgrad": gg.grouped_gemm_dgrad, "wgrad": gg.grouped_gemm_wgrad}[op]
    return fn(a, b, splits, recipe=recipe, backend=backend, **kw)


def _operands(op, groups, m, n, k, gen):
    """fwd: x (M, K), w (G, N, K); dgrad: dy (M, N), w; wgrad: dy (M, N), x (M, K)."""

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, torch.bfloat16)

    if op == "wgrad":
        return rnd(m, n), rnd(m, k)
    return rnd(m, k if op == "fwd" else n), rnd(groups, n, k)


def _out(op, groups, m, n, k, dtype):
    shape = (groups, n, k) if op == "wgrad" else (m, n if op == "fwd" else k)
    return poison(torch.empty(shape, dtype=dtype, device=DEVICE))


def _splits(kind, groups, m, gen):
    if kind == "balanced":
        return gg.balanced_splits(groups, m)
    if kind == "skewed":
        return gg.skewed_splits(groups, m)
    return random_splits(groups, m, empty=groups // 3, generator=gen)


@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize("rule", ["rceil", "floor"])
@pytest.mark.parametrize(
    ("kind", "groups", "m", "n", "k"),
    [
        ("balanced", 8, 2048, 512, 1024),
        ("skewed", 16, 3000, 384, 768),
        ("empty", 12, 1000, 256, 512),
        ("balanced", 1, 333, 256, 256),
        ("skewed", 5, 777, 200, 136),  # nothing a multiple of 32 or of the 128-row tile
        ("empty", 7, 97, 48, 80),
        ("skewed", 3, 250, 45, 96),  # an odd number of output columns (fwd): no paired stores
        ("skewed", 4, 300, 45, 75),  # output rows of every op out of 16-byte alignment: no 16-byte runs
    ],
    ids=["balanced", "skewed", "empty_groups", "g1", "unaligned", "small", "odd_columns", "odd_rows_every_op"],
)
def test_matches_reference(op, rule, kind, groups, m, n, k, gen):
    splits = _splits(kind, groups, m, gen)
    a, b = _operands(op, groups, m, n, k, gen)
    recipe = _recipe(rule)
    want = _call(op, a, b, splits, recipe, "reference", out_dtype=torch.float32)
    for device_splits in (False, True):
        s = torch.tensor(splits, device=DEVICE) if device_splits else splits
        out = _out(op, groups, m, n, k, torch.float32)
        got = _call(op, a, b, s, recipe, NAME, out=out)
        assert got is out
        assert sqnr_db(got, want) >= MIN_SQNR, (device_splits, sqnr_db(got, want))
    if op == "wgrad":
        empty = [g for g, rows in enumerate(splits) if rows == 0]
        assert torch.count_nonzero(got[empty]) == 0


@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize(("n", "k"), [(320, 448), (45, 75)], ids=["aligned", "odd_rows"])
def test_bf16_output(op, n, k, gen):
    """bf16 results: the fp32 accumulation rounded once (as close as the reference's own bf16),
    in 16-byte runs or, where out's rows are not 16-byte aligned, element by element."""
    groups, m = 6, 1500
    splits = gg.skewed_splits(groups, m)
    a, b = _operands(op, groups, m, n, k, gen)
    want = _call(op, a, b, splits, "mxfp8", "reference", out_dtype=torch.float32)
    ref_bf16 = _call(op, a, b, splits, "mxfp8", "reference")
    got = _call(op, a, b, splits, "mxfp8", NAME, out=_out(op, groups, m, n, k, torch.bfloat16))
    assert got.dtype == torch.bfloat16
    assert sqnr_db(got, want) >= sqnr_db(ref_bf16, want) - 1.0


def test_wgrad_accumulates_into_fp32_main_grad(gen):
    groups, m, n, k = 8, 1200, 256, 384
    splits = random_splits(groups, m, empty=2, generator=gen)
    dy, x = _operands("wgrad", groups, m, n, k, gen)
    main_grad = torch.randn(groups, n, k, generator=gen).to(DEVICE)
    before = main_grad.clone()
    delta = _call("wgrad", dy, x, splits, "mxfp8", "reference", out_dtype=torch.float32)
    got = _call("wgrad", dy, x, splits, "mxfp8", NAME, out=main_grad, accumulate=True)
    assert got is main_grad
    assert sqnr_db(main_grad, before + delta) >= MIN_SQNR
    empty = [g for g, rows in enumerate(splits) if rows == 0]
    assert torch.equal(main_grad[empty], before[empty])


def test_wgrad_accumulates_into_bf16_rounding_once(gen):
    """bf16 added into: the kernel sums in fp32 and rounds once, as close as the reference's own
    rounding of (before + delta); empty groups stay bit for bit."""
    groups, m, n, k = 6, 900, 192, 320
    splits = random_splits(groups, m, empty=2, generator=gen)
    dy, x = _operands("wgrad", groups, m, n, k, gen)
    grad = torch.randn(groups, n, k, generator=gen).to(DEVICE, torch.bfloat16)
    before = grad.clone()
    want = before.double() + _call("wgrad", dy, x, splits, "mxfp8", "reference", out_dtype=torch.float32).double()
    got = _call("wgrad", dy, x, splits, "mxfp8", NAME, out=grad, accumulate=True)
    assert got is grad
    assert sqnr_db(grad, want) >= sqnr_db(want.to(torch.bfloat16), want) - 1.0
    empty = [g for g, rows in enumerate(splits) if rows == 0]
    assert torch.equal(grad[empty], before[empty])


@pytest.mark.parametrize("op", ["fwd", "dgrad"])
def test_prequantized_operands_and_nan_scale(op, gen):
    """MXTensor operands as given; a scale byte of 255 makes its rows NaN, as in reference."""
    groups, m, n, k = 4, 640, 256, 512
    splits = gg.balanced_splits(groups, m)
    a, w = _operands(op, groups, m, n, k, gen)
    aq = quantize_mx(a, "e4m3", axis=1)
    wq = quantize_mx_weight(w, "e4m3", op=op)
    aq.scale[5, 3] = 255
    want = _call(op, aq, wq, splits, "mxfp8", "reference", out_dtype=torch.float32)
    got = _call(op, aq, wq, splits, "mxfp8", NAME, out=_out(op, groups, m, n, k, torch.float32))
    assert torch.isnan(got[5]).all() and torch.isnan(want[5]).all()
    keep = torch.ones(m, dtype=torch.bool, device=DEVICE)
    keep[5] = False
    assert sqnr_db(got[keep], want[keep]) >= MIN_SQNR


@pytest.mark.parametrize("op", ["fwd", "dgrad"])
def test_scale_spread_at_and_past_the_prescaled_limit(op, gen):
    """A tile whose rows' scales span 15 binades takes the prescaled path, 16 the per-block one.
    Block 0's codes are zeroed under the largest scale, so every product comes from blocks at
    2^-15 (or 2^-16) of it: one flushed or mis-scaled fragment shows as a large error."""
    groups, m, n, k = 2, 256, 128, 256
    splits = [128, 128]
    a, w = _operands(op, groups, m, n, k, gen)
    aq = quantize_mx(a, "e4m3", axis=1)
    wq = quantize_mx_weight(w, "e4m3", op=op)
    aq.scale.fill_(120)
    aq.data[:, :32] = 0
    aq.scale[:128, 0] = 135  # group 0's tile: a spread of 15
    aq.scale[128:, 0] = 136  # group 1's tile: 16
    want = _call(op, aq, wq, splits, "mxfp8", "reference", out_dtype=torch.float32)
    got = _call(op, aq, wq, splits, "mxfp8", NAME, out=_out(op, groups, m, n, k, torch.float32))
    assert want.abs().amax() > 0
    for rows in (slice(0, 128), slice(128, 256)):
        assert sqnr_db(got[rows], want[rows]) >= MIN_SQNR


def test_wgrad_scale_spread_at_and_past_the_prescaled_limit(gen):
    """wgrad at the prescaled path's limit: dy's rows (its columns, per group) span 15 binades
    in group 0 and 16 in group 1 (token block 0 at 2^15, 2^16), so group 0's tile takes the
    prescaled path and group 1's the per-block one; x's block 0 at 2^-15, 2^-16 keeps every
    block's products the same size (+-1 each), so one flushed or mis-scaled block shows as a
    large error."""
    groups, m, n, k = 2, 256, 128, 128
    splits = [128, 128]

    def signs(*shape):
        return torch.randint(0, 2, shape, generator=gen).float() * 2 - 1

    dy, x = signs(m, n), signs(m, k)
    dy[:32] *= 2.0**15
    dy[128:160] *= 2.0**16
    x[:32] *= 2.0**-15
    x[128:160] *= 2.0**-16
    dy, x = dy.to(DEVICE, torch.bfloat16), x.to(DEVICE, torch.bfloat16)
    want = _call("wgrad", dy, x, splits, "mxfp8", "reference", out_dtype=torch.float32)
    got = _call("wgrad", dy, x, splits, "mxfp8", NAME, out=_out("wgrad", groups, m, n, k, torch.float32))
    assert want.abs().amax() > 0
    for g in range(groups):
        assert sqnr_db(got[g], want[g]) >= MIN_SQNR


def test_wgrad_over_many_tiles_of_mixed_groups(gen):
    """wgrad over 480 tiles (several waves of blocks) mixing empty groups (zeros), groups of
    one stage, groups of many, and two groups whose scales span more than 15 binades (their
    tiles take the per-block path amid prescaled ones)."""
    splits = [0, 32, 100, 0, 256, 7, 64, 300, 0, 33, 128, 1, 500, 96, 0, 40, 64, 200, 3, 0, 160, 31, 90, 65]
    groups, m, n, k = len(splits), sum(splits), 512, 640
    dy, x = _operands("wgrad", groups, m, n, k, gen)
    starts = [sum(splits[:g]) for g in range(groups)]
    for g in (4, 17):  # +-2^20 on one token of the group's first 32: every row's spread > 15
        dy[starts[g]] = dy[starts[g]].sign() * 2.0**20
    want = _call("wgrad", dy, x, splits, "mxfp8", "reference", out_dtype=torch.float32)
    got = _call("wgrad", dy, x, splits, "mxfp8", NAME, out=_out("wgrad", groups, m, n, k, torch.float32))
    for g, size in enumerate(splits):
        if size == 0:
            assert torch.count_nonzero(got[g]) == 0
        else:
            assert sqnr_db(got[g], want[g]) >= MIN_SQNR, g


@pytest.mark.parametrize("op", ["dgrad", "wgrad"])
def test_contraction_tails_never_reach_the_next_group(op, gen):
    """A tile's last stage runs past its group's contraction into the next group's codes
    (dgrad: the weight read k-outer, group 0's N = 96 steps of a 128-step stage; wgrad: group
    0's 64 padded tokens). Group 1 is NaN there, so a stage that took those codes instead of
    zeros would make group 0 NaN; only group 1's own outputs may be."""
    groups, n, k = 2, 96 if op == "dgrad" else 64, 64 if op == "dgrad" else 48
    splits = [40, 100]
    m = sum(splits)
    a, b = _operands(op, groups, m, n, k, gen)
    if op == "dgrad":
        b[1] = float("nan")  # the weight of group 1
    else:
        a[40:] = float("nan")  # group 1's tokens of dy
    want = _call(op, a, b, splits, "mxfp8", "reference", out_dtype=torch.float32)
    got = _call(op, a, b, splits, "mxfp8", NAME, out=_out(op, groups, m, n, k, torch.float32))
    own, other = (slice(0, 40), slice(40, m)) if op == "dgrad" else (0, 1)
    assert torch.isnan(want[other]).all() and torch.isnan(got[other]).all()
    assert torch.isfinite(got[own]).all() and sqnr_db(got[own], want[own]) >= MIN_SQNR


def test_all_groups_empty():
    x = torch.empty(0, 256, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(3, 128, 256, device=DEVICE, dtype=torch.bfloat16)
    assert _call("fwd", x, w, [0, 0, 0], "mxfp8", NAME).shape == (0, 128)
    dy = torch.empty(0, 128, device=DEVICE, dtype=torch.bfloat16)
    dw = _call("wgrad", dy, x, [0, 0, 0], "mxfp8", NAME, out=_out("wgrad", 3, 0, 128, 256, torch.float32))
    assert torch.count_nonzero(dw) == 0


@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
def test_cuda_graph_capture_and_replay(op, gen):
    """Device splits: nothing is read on the host, so the call captures; replay with new splits."""
    groups, m, n, k = 8, 1024, 256, 512
    a, b = _operands(op, groups, m, n, k, gen)
    splits = torch.tensor(gg.balanced_splits(groups, m), device=DEVICE)
    out = _out(op, groups, m, n, k, torch.float32)
    _call(op, a, b, splits, "mxfp8", NAME, out=out)  # warm up: build, autotune-free, caches
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _call(op, a, b, splits, "mxfp8", NAME, out=out)
    new = random_splits(groups, m, empty=2, generator=gen)
    splits.copy_(torch.tensor(new))
    poison(out)
    graph.replay()
    torch.cuda.synchronize()
    want = _call(op, a, b, new, "mxfp8", "reference", out_dtype=torch.float32)
    assert sqnr_db(out, want) >= MIN_SQNR
    assert not math.isnan(out.sum().item())


def test_portable_inner_product_matches_mma(tmp_path, gen):
    """The ROCm inner product (software E4M3 decode), compiled for this GPU, against mma.sync."""
    arch = gg.explain(op="fwd", recipe="mxfp8", groups=1, m=1, n=32, k=32).problem.device.arch
    portable = build.compile_extension(arch, tmp_path, portable=True)
    fast = build.ensure(arch, "cuda").module
    groups, m, n, k = 3, 300, 200, 160
    splits = torch.tensor([100, 0, 200], dtype=torch.int32, device=DEVICE)
    ends = torch.cumsum(splits, 0, dtype=torch.int32)
    tile_ends = torch.cumsum((splits + 127) // 128, 0, dtype=torch.int32)
    x = quantize_mx(torch.randn(m, k, generator=gen).to(DEVICE), "e4m3", axis=1)
    w = quantize_mx_weight(torch.randn(groups, n, k, generator=gen).to(DEVICE), "e4m3")
    outs = []
    for module in (fast, portable):
        out = poison(torch.empty(m, n, device=DEVICE))
        module.rows_gemm(x.data, x.scale, w.data, w.scale, ends, tile_ends, 3 + groups, out, False)
        outs.append(out)
    want = gg.grouped_gemm(x, w, [100, 0, 200], recipe="mxfp8", out_dtype=torch.float32, backend="reference")
    assert sqnr_db(outs[1], want) >= MIN_SQNR
    assert sqnr_db(outs[1], outs[0]) >= 90.0


@pytest.fixture(scope="module")
def shared_a(tmp_path_factory):
    """The GG_MXFP8_REG_A=0 build (A through shared memory), compiled once for the module:
    nvcc takes a minute or more a build, and a build per parametrization ran the GPU job
    out of time."""
    arch = gg.explain(op="fwd", recipe="mxfp8", groups=1, m=1, n=32, k=32).problem.device.arch
    return build.compile_extension(arch, tmp_path_factory.mktemp("shared_a"), defines=("GG_MXFP8_REG_A=0",))


@pytest.mark.parametrize(("op", "k_outer"), [("fwd", False), ("dgrad", True), ("dgrad", False)])
def test_register_a_matches_the_shared_memory_path(shared_a, gen, op, k_outer):
    """The default build (A to wgmma from registers, contraction order permuted alike in A and
    B, or B's natural order for a k-outer weight) against GG_MXFP8_REG_A=0 (A through shared
    memory): the same products (empty and partial groups, a partial last stage, columns short
    of a tile)."""
    arch = gg.explain(op="fwd", recipe="mxfp8", groups=1, m=1, n=32, k=32).problem.device.arch
    register_a = build.ensure(arch, "cuda").module
    groups, m, n, k = 3, 300, 224, 416
    splits = torch.tensor([100, 0, 200], dtype=torch.int32, device=DEVICE)
    ends = torch.cumsum(splits, 0, dtype=torch.int32)
    tile_ends = torch.cumsum((splits + 127) // 128, 0, dtype=torch.int32)
    contraction, columns = (k, n) if op == "fwd" else (n, k)
    a = quantize_mx(torch.randn(m, contraction, generator=gen).to(DEVICE), "e4m3", axis=1)
    w = quantize_mx_weight(torch.randn(groups, n, k, generator=gen).to(DEVICE), "e4m3", op=op)
    w_data, w_scale = w.data, w.scale
    if op == "dgrad" and not k_outer:
        w_data, w_scale = w.data.transpose(1, 2).contiguous(), w.scale.transpose(1, 2).contiguous()
    outs = []
    for module in (shared_a, register_a):
        out = poison(torch.empty(m, columns, device=DEVICE))
        module.rows_gemm(a.data, a.scale, w_data, w_scale, ends, tile_ends, 3 + groups, out, k_outer)
        outs.append(out)
    call = gg.grouped_gemm if op == "fwd" else gg.grouped_gemm_dgrad
    want = call(a, w, [100, 0, 200], recipe="mxfp8", out_dtype=torch.float32, backend="reference")
    assert sqnr_db(outs[1], want) >= MIN_SQNR
    assert sqnr_db(outs[1], outs[0]) >= 90.0


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_k_outer_operands_equal_their_transposed_copies(out_dtype, gen):
    """dgrad's weight and wgrad's token-major operands are read as quantized and transposed on
    chip: bit for bit the result of the contraction-major copies (empty and
    partial groups, columns short of a tile, NaN scales)."""
    fast = build.ensure(
        gg.explain(op="fwd", recipe="mxfp8", groups=1, m=1, n=32, k=32).problem.device.arch, "cuda"
    ).module
    groups, m, n, k = 3, 300, 160, 208
    splits = torch.tensor([100, 0, 200], dtype=torch.int32, device=DEVICE)
    ends = torch.cumsum(splits, 0, dtype=torch.int32)
    tile_ends = torch.cumsum((splits + 127) // 128, 0, dtype=torch.int32)
    dy = quantize_mx(torch.randn(m, n, generator=gen).to(DEVICE), "e4m3", axis=1)
    w = quantize_mx_weight(torch.randn(groups, n, k, generator=gen).to(DEVICE), "e4m3", op="dgrad")
    w.scale[1, 2, 5] = 255  # NaN: one output column of group 1's rows (group 1 is empty) ...
    w.scale[2, 1, 7] = 255  # ... and of group 2's
    outs = []
    for k_outer in (True, False):
        w_data = w.data if k_outer else w.data.transpose(1, 2).contiguous()
        w_scale = w.scale if k_outer else w.scale.transpose(1, 2).contiguous()
        out = poison(torch.empty(m, k, device=DEVICE, dtype=out_dtype))
        fast.rows_gemm(dy.data, dy.scale, w_data, w_scale, ends, tile_ends, 3 + groups, out, k_outer)
        outs.append(out)
    assert torch.equal(outs[0].isnan(), outs[1].isnan()) and outs[0][:, 7].isnan()[100:].all()
    assert torch.equal(outs[0].nan_to_num(), outs[1].nan_to_num())
    rows = quantize_mx_rows(torch.randn(m, n, generator=gen).to(DEVICE), [100, 0, 200], "e4m3", align=32)
    cols = quantize_mx_rows(torch.randn(m, k, generator=gen).to(DEVICE), [100, 0, 200], "e4m3", align=32)
    pad_ends = rows.padded_offsets[1:].contiguous()
    grads = []
    for k_outer in (True, False):
        a, b = rows.tensor, cols.tensor
        operands = (a.data, a.scale, b.data, b.scale)
        if not k_outer:
            operands = tuple(t.t().contiguous() for t in operands)
        out = poison(torch.empty(groups, n, k, device=DEVICE, dtype=out_dtype))
        fast.wgrad_gemm(*operands, pad_ends, out, False, k_outer)
        grads.append(out)
    assert torch.equal(grads[0], grads[1]) and not grads[0][1].any()


def test_selected_by_dispatch_on_this_gpu():
    d = gg.explain(op="fwd", recipe="mxfp8", groups=8, m=4096, n=1024, k=1024)
    assert d.candidate(NAME).eligible, d.table()
