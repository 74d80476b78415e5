"""The upcast weight layout built on the device (``backends/triton_mx/weight_prep_kernel``).

Both builders are checked bit for bit against ``_reference_layout``, the layout's
definition written in torch one group at a time (layouts.py's docstring): the fused
quantize-and-lay-out kernel against ``quantize_mx_weight`` (the torch quantizer on the CPU)
followed by the reference, and the MXTensor builder against the reference on the same
MXTensor. Layout buffers are poisoned first, so a word or scale a kernel forgets shows up.
On the CPU the kernels run in Triton's interpreter; ``pytest -m gpu`` repeats the check on
a GPU at a realistic size and, there, against the Triton quantizer.
"""

from __future__ import annotations

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm.backends.triton_mx import decode, layouts, layouts_e4m3, weight_prep_kernel
from grouped_gemm.mx import MXTensor, quantize_mx_weight
from grouped_gemm.testing import poison, ref_fwd, sqnr_db

K_ALIGN = layouts.K_ALIGN
POISON_WORD = 0x5A5A5A5A


def _reference_layout(mx: MXTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(data (G, rows, runs, 16), scales (G, runs, rows)) int32, per group with torch ops:
    element ``32b + 8j + 2q + h`` of each 128-run -> word ``4q + b``, code bits at
    ``decode.E2M1_BITS[j][h]``; scale bytes of blocks ``4r .. 4r + 3`` little-endian in one int32; zero padding."""
    groups = mx.shape[0]
    rows = mx.shape[1] if mx.axis == 2 else mx.shape[2]
    k_red = mx.shape[mx.axis]
    k_padded = -(-k_red // K_ALIGN) * K_ALIGN
    runs = k_padded // K_ALIGN
    data = torch.empty(groups, rows, runs, 16, dtype=torch.int32)
    scales = torch.empty(groups, runs, rows, dtype=torch.int32)
    for g in range(groups):
        d = mx.data[g].cpu()
        if mx.axis == 2:
            codes = torch.stack((d & 15, d >> 4), dim=-1).reshape(d.shape[0], -1)
            blocks = mx.scale[g].cpu()
        else:
            codes = torch.stack((d & 15, d >> 4), dim=1).reshape(-1, d.shape[1]).T
            blocks = mx.scale[g].cpu().T
        codes = torch.nn.functional.pad(codes, (0, k_padded - k_red)).to(torch.int64)
        nibbles = codes.reshape(rows, runs, 4, 4, 4, 2).permute(0, 1, 4, 2, 5, 3).reshape(rows, runs, 16, 8)
        words = _place_codes(nibbles)
        data[g] = (words - ((words >> 31) << 32)).to(torch.int32)
        blocks = torch.nn.functional.pad(blocks, (0, (k_padded - k_red) // 32))
        scales[g] = blocks.contiguous().view(torch.int32).T
    return data, scales


def _place_codes(codes: torch.Tensor) -> torch.Tensor:
    """(..., 8) int64 E2M1 codes of elements (j, h) in order ``j + 4h`` -> (...) words, every
    code bit where ``decode.E2M1_BITS`` says."""
    words = torch.zeros(codes.shape[:-1], dtype=torch.int64)
    for i in range(8):
        for bit, place in enumerate(decode.E2M1_BITS[i % 4][i // 4]):
            words |= ((codes[..., i] >> bit) & 1) << place
    return words


def test_e2m1_word_arrangement_is_a_permutation_written_in_six_moves():
    """Every bit of a stored E2M1 word holds exactly one code bit, and the prep kernels'
    six rotate-and-mask terms (which their jit code lists one by one) put every bit."""
    places = sorted(b for pair in decode.E2M1_BITS for lane in pair for b in lane)
    assert places == list(range(32))
    moves = weight_prep_kernel._nibble_order_moves()
    assert len(moves) == 6
    masks = [mask for _, mask in moves]
    assert sum(masks) == 0xFFFFFFFF and all(a & b == 0 for i, a in enumerate(masks) for b in masks[i + 1 :])


@pytest.fixture
def poisoned_layouts(monkeypatch):
    """Layouts start filled with a poison word instead of whatever memory held."""
    empty = layouts._empty_layout

    def poisoned(*args, **kwargs):
        lay = empty(*args, **kwargs)
        lay.data.fill_(POISON_WORD)
        lay.scales.fill_(POISON_WORD)
        return lay

    monkeypatch.setattr(layouts, "_empty_layout", poisoned)


def _edge_weight(shape: tuple[int, int, int], op: str, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random normal values scaled per 32-block (along the op's contraction) by 2^e, e in
    [-140, 127] (bf16 / fp32; fp16: [-20, 12]) so the scale bytes cover their range; plus
    an all-zero block, a block holding NaN, one holding Inf, one holding -Inf, and one at
    fp32 subnormal magnitudes (scale byte 0 / 1 edges)."""
    g, n, k = shape
    fp16 = dtype == torch.float16
    lo, hi = (-20, 12) if fp16 else (-140, 127)
    w = torch.randn(g, n, k, generator=gen, dtype=torch.float64)
    if op == "fwd":
        exps = torch.randint(lo, hi, (g, n, k // 32, 1), generator=gen).expand(g, n, k // 32, 32).reshape(g, n, k)
    else:
        exps = torch.randint(lo, hi, (g, n // 32, 1, k), generator=gen).expand(g, n // 32, 32, k).reshape(g, n, k)
    w = (w * torch.exp2(exps.double())).to(dtype)
    w[0, 0, :32] = 0
    w[-1, 1, 1] = float("nan")
    w[-1, 2, 33] = float("inf")
    w[0, 3, 5] = float("-inf")
    if not fp16:
        w[0, 4, :32] = torch.randn(32, generator=gen).double().mul(2.0**-140).to(dtype)
    return w


SHAPES = [(3, 64, 160), (2, 96, 96), (1, 32, 288)]  # K not a multiple of 128; N multiples of 32


def _layout_of(mx: MXTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout's definition for the MXTensor's format: the reference above for E2M1,
    the torch builder of ``layouts_e4m3`` (rows contiguous) for E4M3."""
    if mx.fmt == "e2m1":
        return _reference_layout(mx)
    lay = layouts_e4m3.build_upcast_weight_e4m3(mx)
    return lay.data.contiguous(), lay.scales


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("op", ["fwd", "dgrad"])
def test_fused_quantize_layout_equals_quantizer_then_layout(fmt, shape, op, poisoned_layouts, gen):
    for dtype, rule in ((torch.bfloat16, "rceil"), (torch.float32, "floor"), (torch.float16, "even")):
        w = _edge_weight(shape, op, dtype, gen)
        data, scales = _layout_of(quantize_mx_weight(w, fmt, op=op, scale_rule=rule))
        lay = layouts.quantize_upcast_weight(w, op, rule, fmt=fmt)
        rows, k_red = (shape[1], shape[2]) if op == "fwd" else (shape[2], shape[1])
        assert (lay.rows, lay.k_red, lay.fmt) == (rows, k_red, fmt)
        assert not lay.small_scales
        assert torch.equal(lay.data, data), (dtype, rule)
        assert torch.equal(lay.scales, scales), (dtype, rule)
    small_tile = layouts.quantize_upcast_weight(w, op, rule, fmt=fmt, tile=(16, 2))  # another tile, same layout
    assert torch.equal(small_tile.data, data) and torch.equal(small_tile.scales, scales)


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
@pytest.mark.parametrize("op", ["fwd", "dgrad"])
def test_both_tile_arrangements_write_the_same_layout(fmt, op, poisoned_layouts, gen):
    """A weight stored (G, K, N) makes fwd's contraction strided and dgrad's contiguous, so
    each op runs the other quantize kernel than for a (G, N, K) weight: same layout."""
    w = _edge_weight(SHAPES[0], op, torch.bfloat16, gen)
    data, scales = _layout_of(quantize_mx_weight(w, fmt, op=op, scale_rule="rceil"))
    for stored in (w, w.transpose(1, 2).contiguous().transpose(1, 2)):
        lay = layouts.quantize_upcast_weight(stored, op, "rceil", fmt=fmt)
        assert torch.equal(lay.data, data) and torch.equal(lay.scales, scales), stored.stride()


@pytest.mark.parametrize("op", ["fwd", "dgrad"])
@pytest.mark.parametrize("run_major", [True, False])
def test_mx_layout_equals_reference_for_every_code_and_scale_byte(op, run_major, poisoned_layouts, gen):
    """Random packed codes and all 256 scale bytes; both memory orders of the layout."""
    g, n, k = 2, 160, 288  # several runs both ways, so the two memory orders differ
    axis = 2 if op == "fwd" else 1
    data_shape = (g, n, k // 2) if axis == 2 else (g, n // 2, k)
    scale_shape = (g, n, k // 32) if axis == 2 else (g, n // 32, k)
    mx = MXTensor(
        data=torch.randint(0, 256, data_shape, generator=gen, dtype=torch.uint8),
        scale=torch.randint(0, 256, scale_shape, generator=gen, dtype=torch.uint8),
        fmt="e2m1",
        axis=axis,
        shape=(g, n, k),
    )
    mx.scale.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    data, scales = _reference_layout(mx)
    lay = layouts.build_upcast_weight(mx, run_major=run_major)
    assert lay.data.is_contiguous() != run_major
    assert torch.equal(lay.data, data) and torch.equal(lay.scales, scales)


def test_small_scales_only_for_cached_prequantized_weights(gen):
    """Per-call layouts never read scales back (no host sync): ``small_scales`` stays off."""
    w = torch.randn(2, 64, 128, generator=gen)
    assert not layouts.quantize_upcast_weight(w, "fwd", "rceil").small_scales
    assert layouts.upcast_weight(quantize_mx_weight(w, "e2m1")).small_scales


@pytest.mark.parametrize(
    "recipe, backend, fmt, floor_db",
    [
        ("mxfp4", "triton_mxfp4", "e2m1", 15),
        ("a16w4", "triton_mxfp4", "e2m1", 17.5),
        ("mxfp8", "triton_mxfp8", "e4m3", 25),  # testing.RECIPE_VS_UNQUANTIZED_DB
    ],
)
def test_fresh_weights_equal_prequantized_weights_end_to_end(recipe, backend, fmt, floor_db, gen):
    """A call with high-precision weights (fused kernel) gives exactly the call with the
    same weights quantized ahead (MXTensor, cached layout), and matches the reference."""
    splits = [21, 0, 2, 40]
    m, n, k = sum(splits), 64, 160
    x = torch.randn(m, k, generator=gen).bfloat16()
    dy = torch.randn(m, n, generator=gen).bfloat16()
    w = torch.randn(len(splits), n, k, generator=gen).bfloat16()
    with gg.use_backends(backend, strict=True):
        fresh = gg.grouped_gemm(x, w, splits, recipe=recipe, out=poison(torch.empty(m, n)))
        fixed = gg.grouped_gemm(x, quantize_mx_weight(w, fmt), splits, recipe=recipe, out_dtype=torch.float32)
        fresh_dx = gg.grouped_gemm_dgrad(dy, w, splits, recipe=recipe, out=poison(torch.empty(m, k)))
        w_dgrad = quantize_mx_weight(w, fmt, op="dgrad")
        fixed_dx = gg.grouped_gemm_dgrad(dy, w_dgrad, splits, recipe=recipe, out_dtype=torch.float32)
    assert torch.equal(fresh, fixed) and torch.equal(fresh_dx, fixed_dx)
    with gg.use_backends("reference", strict=True):
        want = gg.grouped_gemm(x, w, splits, recipe=recipe, out_dtype=torch.float32)
    assert sqnr_db(fresh, want) >= 60
    assert sqnr_db(fresh, ref_fwd(x.double(), w.double(), splits)) >= floor_db


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
@pytest.mark.parametrize("op", ["fwd", "dgrad"])
def test_gpu_fused_layout_equals_triton_quantizer_then_layout(fmt, op, gen):
    """qwen3-30B gate-up size (G=16 of 128 experts), bf16 and fp32, all three rules."""
    for dtype, rule in ((torch.bfloat16, "rceil"), (torch.float32, "floor"), (torch.bfloat16, "even")):
        w = _edge_weight((16, 1536, 2048), op, dtype, gen).cuda()
        mx = quantize_mx_weight(w, fmt, op=op, scale_rule=rule)
        if fmt == "e2m1":
            want = layouts.build_upcast_weight(mx)
            data, scales = _reference_layout(mx)
            assert torch.equal(want.data.cpu(), data) and torch.equal(want.scales.cpu(), scales)
        else:
            want = layouts_e4m3.build_upcast_weight_e4m3(mx)
        lay = layouts.quantize_upcast_weight(w, op, rule, fmt=fmt)
        assert torch.equal(lay.data, want.data) and torch.equal(lay.scales, want.scales), (dtype, rule)
        for tile in ((16, 2), (32, 2), (64, 4), (128, 4)):  # the defaults are picked by timing any of these
            other = layouts.quantize_upcast_weight(w, op, rule, fmt=fmt, tile=tile)
            assert torch.equal(other.data, want.data) and torch.equal(other.scales, want.scales), (dtype, rule, tile)
