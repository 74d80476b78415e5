"""Property tests: the torch quantizer against a pure-Python oracle written from the rules
(float64 / numpy-fp32 arithmetic, brute-force nearest-even search), round-trip
invariants, packing, axis and padding consistency, and round-trip SQNR."""

from __future__ import annotations

import copy
import io
import itertools
import math
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import grouped_gemm as gg
from grouped_gemm.mx.formats import FORMATS
from grouped_gemm.testing import sqnr_db

RULES = ("floor", "rceil", "even")


def _grid(fmt: str) -> list[tuple[float, int]]:
    """(value, code) of every non-negative finite element, ascending."""
    if fmt == "e2m1":
        return [(v, c) for c, v in enumerate((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0))]
    dtype = FORMATS[fmt].storage
    values = torch.arange(128, dtype=torch.uint8).view(dtype).float().tolist()
    return [(v, c) for c, v in enumerate(values) if math.isfinite(v)]


GRIDS = {f: _grid(f) for f in FORMATS}


def oracle_exponent(amax: float, fmt: str, rule: str) -> int:
    f = FORMATS[fmt]
    if amax == 0.0:
        return -127
    mantissa, exponent = math.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    if rule == "floor":
        e = exponent - 1 - f.emax
    elif rule == "rceil":
        q = float(np.float32(amax) / np.float32(f.max_value))  # IEEE fp32 quotient, subnormals kept
        if q <= 2.0**-127:
            e = -127
        else:
            mq, eq = math.frexp(q)
            e = eq - 1 if mq == 0.5 else eq
    else:
        bits = f.mbits + 1
        rounded = math.floor(mantissa * 2**bits + 0.5) * 2.0 ** (exponent - bits)
        e = math.frexp(rounded)[1] - 1 - f.emax
    return max(-127, min(127, e))


def oracle_code(v: float, fmt: str) -> int:
    grid = GRIDS[fmt]
    sign = (1 << (FORMATS[fmt].bits - 1)) if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    best = grid[-1][1]
    if a < grid[-1][0]:
        for (lo, lo_code), (hi, hi_code) in itertools.pairwise(grid):
            if lo <= a <= hi:
                if a - lo < hi - a:
                    best = lo_code
                elif hi - a < a - lo:
                    best = hi_code
                else:
                    best = lo_code if lo_code % 2 == 0 else hi_code
                break
    return best | sign


def oracle_block(values: list[float], fmt: str, rule: str) -> tuple[int, list[int]]:
    if not all(math.isfinite(v) for v in values):
        return 0xFF, [0] * len(values)
    e = oracle_exponent(max(abs(v) for v in values), fmt, rule)
    return e + 127, [oracle_code(v * 2.0**-e, fmt) for v in values]


def element_codes(q: gg.MXTensor) -> list[int]:
    raw = q.data.view(torch.uint8).flatten().tolist()
    if q.fmt != "e2m1":
        return raw
    return [c for byte in raw for c in (byte & 0xF, byte >> 4)]


def f32_bits_to_float(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


def _interesting_fp32() -> st.SearchStrategy[float]:
    """Wide-range floats plus values next to the formats' maxima and E2M1 midpoints."""
    near = st.builds(
        lambda base, k, ulps: _nudge(base * 2.0**k, ulps),
        st.sampled_from([448.0, 57344.0, 6.0, 3.5, 0.25, 0.75, 2.5, 5.0, 1.0, 1.75]),
        st.integers(-140, 110),
        st.integers(-2, 2),
    )
    return st.one_of(st.floats(width=32, allow_nan=False, allow_infinity=False), near)


def _nudge(value: float, ulps: int) -> float:
    """``value`` in fp32, moved by ``ulps`` units in the last place."""
    v = np.float32(value)
    if not np.isfinite(v) or v == 0:
        return float(v)
    bits = int(np.array([v], dtype=np.float32).view(np.uint32)[0]) + ulps
    return f32_bits_to_float(bits)


@st.composite
def fp32_blocks(draw: st.DrawFn, specials: bool = True) -> torch.Tensor:
    """Two blocks of 32: one drawn wide, one scaled from a common exponent (so that the
    block max is not always dominating) and sometimes a NaN or Inf."""
    wide = draw(st.lists(_interesting_fp32(), min_size=32, max_size=32))
    k = draw(st.integers(-149, 120))
    mantissas = draw(st.lists(st.floats(-8.0, 8.0, width=32), min_size=32, max_size=32))
    scaled = [float(np.float32(m * 2.0**k)) for m in mantissas]
    if specials and draw(st.booleans()):
        scaled[draw(st.integers(0, 31))] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    return torch.tensor(wide + scaled, dtype=torch.float32)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
@settings(max_examples=40, deadline=None)
@given(x=fp32_blocks())
def test_torch_quantizer_matches_the_oracle(fmt, rule, x):
    q = gg.quantize_mx(x, fmt, scale_rule=rule)
    codes = element_codes(q)
    for b in range(2):
        values = x[32 * b : 32 * (b + 1)].tolist()
        scale, want = oracle_block(values, fmt, rule)
        assert q.scale[b].item() == scale, (b, values)
        assert codes[32 * b : 32 * (b + 1)] == want, (b, values)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
@settings(max_examples=25, deadline=None)
@given(x=fp32_blocks(specials=False), dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_low_precision_inputs_match_the_oracle(fmt, dtype, x):
    x = x.to(dtype)
    if not torch.isfinite(x).all():  # fp16 overflowed to Inf: covered by the NaN / Inf tests
        x = torch.nan_to_num(x, posinf=1.0, neginf=-1.0)
    q = gg.quantize_mx(x, fmt)
    codes = element_codes(q)
    for b in range(2):
        values = x[32 * b : 32 * (b + 1)].float().tolist()
        scale, want = oracle_block(values, fmt, "rceil")
        assert q.scale[b].item() == scale
        assert codes[32 * b : 32 * (b + 1)] == want


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
@settings(max_examples=25, deadline=None)
@given(x=fp32_blocks(specials=False))
def test_round_trip_invariants(fmt, rule, x):
    x = x.clamp(-1e38, 1e38)  # an element rounded up near FLT_MAX may be 2^128, an fp32 Inf
    f = FORMATS[fmt]
    q = gg.quantize_mx(x, fmt, scale_rule=rule)
    deq = q.dequantize().double()
    scale = torch.exp2(q.scale.double() - 127).repeat_interleave(32)
    xd = x.double()
    # Signs survive; magnitudes never exceed max * scale; the error is at most half a step
    # of the element grid at that magnitude (or the saturation gap).
    assert ((deq == 0) | (torch.sign(deq) == torch.sign(xd))).all()
    assert (deq.abs() <= f.max_value * scale).all()
    min_step = 2.0 ** (1 - f.bias - f.mbits)
    step = torch.clamp(torch.exp2(torch.floor(torch.log2(xd.abs() / scale)) - f.mbits), min=min_step) * scale
    saturated = xd.abs() > f.max_value * scale
    err = (deq - xd).abs()
    assert (err[~saturated] <= step[~saturated] / 2).all()
    assert (deq[saturated].abs() == (f.max_value * scale)[saturated]).all()
    # Quantizing the dequantized values again reproduces them (a fixed point).
    again = gg.quantize_mx(deq.float(), fmt, scale_rule=rule).dequantize().double()
    assert torch.equal(again, deq)
    if rule == "floor":  # the binade never moves, so the bytes are identical too
        q2 = gg.quantize_mx(deq.float(), fmt, scale_rule=rule)
        assert torch.equal(q2.scale, q.scale)
        assert torch.equal(q2.data.view(torch.uint8), q.data.view(torch.uint8))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
@settings(max_examples=30, deadline=None)
@given(
    mantissas=st.lists(st.floats(-8.0, 8.0, width=32), min_size=64, max_size=64),
    j=st.integers(-40, 40),
    k=st.integers(-20, 20),
)
def test_power_of_two_scaling_moves_only_the_scale(fmt, mantissas, j, k):
    # x and x * 2^k are exact fp32 and no scale reaches the E8M0 clamp: same elements.
    m = torch.tensor(mantissas)
    x = torch.where(m.abs() < 2.0**-20, 0.0, m) * 2.0**j
    x[0] = 1.0 * 2.0**j  # no all-zero block
    x[32] = -3.0 * 2.0**j
    q = gg.quantize_mx(x, fmt)
    q2 = gg.quantize_mx(x * 2.0**k, fmt)
    assert torch.equal(q2.data.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(q2.scale.int(), q.scale.int() + k)


@settings(max_examples=50, deadline=None)
@given(
    codes=st.lists(st.integers(0, 15), min_size=64, max_size=64), byte=st.integers(1, 250)
)  # 6 * 2^(254 - 127) would overflow fp32
def test_e2m1_packing_low_nibble_first(codes, byte):
    c = torch.tensor(codes, dtype=torch.uint8)
    packed = c[0::2] | (c[1::2] << 4)
    q = gg.MXTensor(data=packed, scale=torch.tensor([byte, byte], dtype=torch.uint8), fmt="e2m1", axis=0, shape=(64,))
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    want = [(-1.0 if v & 8 else 1.0) * table[v & 7] * 2.0 ** (byte - 127) for v in codes]
    assert q.dequantize().tolist() == want
    # and the quantizer writes the same layout: requantizing the values gives these bytes
    # (up to the sign of zero, and the scale when the block's max code is below 6)
    back = gg.quantize_mx(q.dequantize(), "e2m1", scale_rule="floor")
    assert torch.equal(back.dequantize(), q.dequantize())


def test_packing_is_along_the_block_axis(gen):
    x = torch.randn(64, 3, generator=gen)
    q = gg.quantize_mx(x, "e2m1", axis=0)
    assert q.data.shape == (32, 3) and q.scale.shape == (2, 3)
    # column j of the axis-0 tensor is the last-axis quantization of x[:, j]: byte i packs
    # rows 2i (low nibble) and 2i + 1 of that column
    for j in range(3):
        row = gg.quantize_mx(x[:, j].contiguous(), "e2m1")
        assert torch.equal(q.data[:, j], row.data)
        assert torch.equal(q.scale[:, j], row.scale)


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_any_axis_equals_moving_it_last(gen, fmt, axis):
    x = torch.randn(32, 64, 96, generator=gen)
    q = gg.quantize_mx(x, fmt, axis=axis)
    last = gg.quantize_mx(x.movedim(axis, -1).contiguous(), fmt)
    assert q.axis == axis % 3
    assert torch.equal(q.scale, last.scale.movedim(-1, axis))
    assert torch.equal(q.data.view(torch.uint8), last.data.view(torch.uint8).movedim(-1, axis))
    assert torch.equal(q.dequantize(), last.dequantize().movedim(-1, axis))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("length", [1, 31, 33, 70])
def test_pad_appends_recorded_zeros(gen, fmt, length):
    x = torch.randn(3, length, generator=gen, dtype=torch.bfloat16)
    q = gg.quantize_mx(x, fmt, pad=True)
    extra = -length % 32
    assert q.pad == extra and q.shape == (3, length) and q.padded_shape == (3, length + extra)
    explicit = gg.quantize_mx(F.pad(x, (0, extra)), fmt)
    assert torch.equal(q.data.view(torch.uint8), explicit.data.view(torch.uint8))
    assert torch.equal(q.scale, explicit.scale)
    assert q.dequantize().shape == (3, length)
    assert torch.equal(q.dequantize(), explicit.dequantize()[:, :length])


def test_leading_dims_and_empty_tensors(gen):
    x = torch.randn(2, 3, 4, 64, generator=gen, dtype=torch.float16)
    q = gg.quantize_mx(x, "e4m3")
    assert q.data.shape == (2, 3, 4, 64) and q.scale.shape == (2, 3, 4, 2)
    assert sqnr_db(q.dequantize(), x) > 28
    empty = gg.quantize_mx(torch.empty(0, 64), "e2m1")
    assert empty.data.shape == (0, 32) and empty.scale.shape == (0, 2)
    assert empty.dequantize().shape == (0, 64)


def _round_trip(q: gg.MXTensor, how: str) -> gg.MXTensor:
    if how == "pickle":
        return pickle.loads(pickle.dumps(q))
    if how == "deepcopy":
        return copy.deepcopy(q)
    buf = io.BytesIO()
    torch.save({"w": q}, buf)
    buf.seek(0)
    return torch.load(buf)["w"]  # the default, weights_only=True


@pytest.mark.parametrize("how", ["pickle", "torch.save", "deepcopy"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
def test_an_mxtensor_survives_pickling(gen, fmt, how):
    """``pickle.dumps`` of an fp8 MXTensor raised torch's ``AttributeError: type object
    'torch.storage.UntypedStorage' has no attribute 'dtype'``, and ``torch.load`` (weights
    only, torch's default) refused the class; both now give back the same tensor."""
    x = torch.randn(36, 5, generator=gen)
    q = gg.quantize_mx(x, fmt, axis=0, block_size=8, pad=True)
    r = _round_trip(q, how)
    assert (r.fmt, r.axis, r.shape, r.pad, r.block_size) == (fmt, 0, (36, 5), 4, 8)
    assert r.data.dtype == q.data.dtype and torch.equal(r.data.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(r.scale, q.scale) and torch.equal(r.dequantize(), q.dequantize())


def test_an_unpickled_mxtensor_is_checked_like_a_new_one():
    """Unpickling used to set the fields without the constructor's checks."""
    q = gg.quantize_mx(torch.randn(4, 64), "e4m3")
    object.__setattr__(q, "shape", (4, 96))
    with pytest.raises(gg.ShapeError, match=r"^data=.*shape \(4, 96\)"):
        pickle.loads(pickle.dumps(q))


# Round-trip SQNR on N(0, 1) data, 1024 x 1024, seed 0 (the figures in docs/mx_formats.md).
SQNR_FLOOR_DB = {"e4m3": 30.0, "e5m2": 25.0, "e2m1": 18.0}


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_sqnr_on_normal_data(fmt, rule, dtype):
    x = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0)).to(dtype)
    db = sqnr_db(gg.quantize_mx(x, fmt, scale_rule=rule).dequantize(), x)
    assert SQNR_FLOOR_DB[fmt] <= db <= SQNR_FLOOR_DB[fmt] + 2.0
