"""Hand-built golden cases for every MX scale rule and element format (OCP MX v1.0, NVIDIA
RCEIL, AMD even). Each block is 32 elements; unnamed elements are filler that does not
change the block's amax."""

from __future__ import annotations

import struct

import pytest
import torch

import grouped_gemm as gg

RULES = ("floor", "rceil", "even")


def f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def block(*values: float, filler: float = 0.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out = torch.full((32,), filler, dtype=torch.float32)
    out[: len(values)] = torch.tensor(values, dtype=torch.float32)
    return out.to(dtype)


def codes(q: gg.MXTensor) -> list[int]:
    return q.data.view(torch.uint8).tolist()


def e2m1_codes(q: gg.MXTensor) -> list[int]:
    data = q.data.tolist()
    return [c for byte in data for c in (byte & 0xF, byte >> 4)]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_zero_block_gives_scale_byte_0_and_zero_elements(rule, fmt, sign):
    q = gg.quantize_mx(block(filler=sign * 0.0), fmt, scale_rule=rule)
    assert q.scale.tolist() == [0]
    deq = q.dequantize()
    assert torch.equal(deq, torch.zeros(32))
    magnitude_bits = 0x7F if fmt != "e2m1" else 0x77
    assert all(b & magnitude_bits == 0 for b in q.data.view(torch.uint8).tolist())


@pytest.mark.parametrize("rule", RULES)
def test_tiny_block_keeps_its_elements(rule):
    # amax / 448 underflows: the scale is 2^-127 (byte 0) and x * 2^127 = 2.0 exactly.
    q = gg.quantize_mx(block(filler=2.0**-126), "e4m3", scale_rule=rule)
    assert q.scale.tolist() == [0]
    assert q.data.float().tolist() == [2.0] * 32
    assert q.dequantize().tolist() == [2.0**-126] * 32


@pytest.mark.parametrize("rule", RULES)
def test_fp32_subnormal_block(rule):
    tiny = f32(0x00000300)  # 3 * 2^-149
    q = gg.quantize_mx(block(tiny, -tiny), "e4m3", scale_rule=rule)
    assert q.scale.tolist() == [0]
    # x * 2^127 = 3 * 2^-22 is below half the smallest e4m3 subnormal (2^-10): zero.
    assert q.data.float().abs().tolist() == [0.0] * 32


@pytest.mark.parametrize(
    ("amax", "rule", "byte", "first"),
    [
        (448.0, "rceil", 127, 448.0),
        (f32(0x43E00001), "rceil", 128, 224.0),  # 448 + 1 ulp: next power of two
        (449.0, "rceil", 128, 224.0),
        (448.0, "floor", 127, 448.0),
        (449.0, "floor", 127, 448.0),  # floor keeps 2^0 and saturates
        (511.0, "floor", 127, 448.0),
        (512.0, "floor", 128, 256.0),
        (448.0, "even", 127, 448.0),
        (479.0, "even", 127, 448.0),  # rounds to 448 at 4 significant bits: saturates
        (480.0, "even", 127, 448.0),  # 1.111b * 2^8 has 4 significant bits already
        (488.0, "even", 127, 448.0),  # 1.11101b rounds down to 1.111b
        (496.0, "even", 128, 256.0),  # 1.1111b ties up to 2^9; 248 then ties to even 256
        (f32(0x7F7FFFFF), "rceil", 247, 256.0),  # FLT_MAX: 2^120, element 255.99998 -> 256
        (f32(0x7F7FFFFF), "floor", 246, 448.0),  # 2^119, element 511.99997 saturates
        (f32(0x7F7FFFFF), "even", 247, 256.0),  # rounds up to 2^128
    ],
)
def test_e4m3_block_max(amax, rule, byte, first):
    q = gg.quantize_mx(block(amax, 1.0), "e4m3", scale_rule=rule)
    assert q.scale.tolist() == [byte]
    assert q.data[0].float().item() == first


@pytest.mark.parametrize(
    ("amax", "rule", "byte"),
    [(57344.0, "rceil", 127), (57345.0, "rceil", 128), (57344.0, "floor", 127), (65535.0, "floor", 127)],
)
def test_e5m2_block_max(amax, rule, byte):
    q = gg.quantize_mx(block(amax), "e5m2", scale_rule=rule)
    assert q.scale.tolist() == [byte]
    assert q.data[0].float().item() == 57344.0 if byte == 127 else 28672.0


@pytest.mark.parametrize(
    ("rule", "byte", "element"),
    [("floor", 127, 6.0), ("rceil", 128, 4.0), ("even", 128, 4.0)],
)
def test_e2m1_block_max_7_under_each_rule(rule, byte, element):
    # floor: 2^(2 - 2) = 1, 7 saturates to 6. rceil: 7/6 -> 2, 7/2 = 3.5 ties to 4.
    # even: 7 = 1.11b * 2^2 rounds (2 significant bits, ties up) to 8 -> 2^(3 - 2) = 2.
    q = gg.quantize_mx(block(7.0, 1.0), "e2m1", scale_rule=rule)
    assert q.scale.tolist() == [byte]
    assert q.dequantize()[0].item() == element * 2.0 ** (byte - 127)


@pytest.mark.parametrize("rule", RULES)
def test_e2m1_ties_to_even(rule):
    # amax 6 gives scale 2^0 under every rule, so the elements are the values themselves.
    values = (6.0, 0.25, 0.75, 1.25, -1.25, 2.5, 5.0, 1.75, 3.5, -0.25, 0.2500001, 2.4999998)
    expect = (6.0, 0.0, 1.0, 1.0, -1.0, 2.0, 4.0, 2.0, 4.0, -0.0, 0.5, 2.0)
    q = gg.quantize_mx(block(*values), "e2m1", scale_rule=rule)
    assert q.scale.tolist() == [127]
    deq = q.dequantize()[: len(values)].tolist()
    assert deq == list(expect)
    assert e2m1_codes(q)[9] == 0x8  # -0.25 rounds to -0: the sign bit stays


@pytest.mark.parametrize("rule", RULES)
def test_e2m1_three_and_a_half_plus_one_ulp(rule):
    just_above = f32(0x40600001)  # 3.5 + 1 ulp
    just_below = f32(0x405FFFFF)
    q = gg.quantize_mx(block(6.0, 3.5, just_above, just_below), "e2m1", scale_rule=rule)
    assert q.dequantize()[:4].tolist() == [6.0, 4.0, 4.0, 3.0]


@pytest.mark.parametrize(("amax", "byte"), [(3.5, 127), (f32(0x40600001), 127), (f32(0x405FFFFF), 126)])
def test_even_rule_rounds_amax_ties_up(amax, byte):
    # e2m1 keeps 2 significant bits: 3.5 = 1.11b * 2^1 ties up to 4 (2^(2-2)); below it, 3.
    q = gg.quantize_mx(block(amax), "e2m1", scale_rule="even")
    assert q.scale.tolist() == [byte]


def test_e4m3_element_ties_to_even():
    # In [16, 32) e4m3 steps by 2: 17 ties to 16, 19 to 20; in [256, 448] by 32: 272 -> 256.
    q = gg.quantize_mx(block(448.0, 17.0, 19.0, 272.0, -17.0, 2.0**-10, 3 * 2.0**-10), "e4m3", scale_rule="floor")
    assert q.data[:7].float().tolist() == [448.0, 16.0, 20.0, 256.0, -16.0, 0.0, 2.0**-8]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_or_inf_block_gets_scale_0xff(fmt, rule, bad):
    x = torch.cat([block(1.0, bad, 3.0), block(1.0, 2.0)])
    q = gg.quantize_mx(x, fmt, scale_rule=rule)
    assert q.scale.tolist()[0] == 0xFF
    assert q.scale.tolist()[1] != 0xFF
    assert q.data.view(torch.uint8)[: 32 // q.format.per_byte].tolist() == [0] * (32 // q.format.per_byte)
    deq = q.dequantize()
    assert torch.isnan(deq[:32]).all()
    assert deq[32:34].tolist() == [1.0, 2.0]


def test_rceil_quotient_is_taken_in_fp32():
    # amax = (7 * 2^21 + 1) * 2^-142: amax / 448 is 2^-127 (1 + 1/(7 * 2^21)), whose fp32
    # (subnormal) rounding is exactly 2^-127: byte 0. One more ulp rounds above: byte 1.
    import numpy as np

    at_edge = (7 * 2**21 + 1) * 2.0**-142
    above = (7 * 2**21 + 2) * 2.0**-142
    assert np.float32(at_edge) / np.float32(448) == np.float32(2.0**-127)
    q = gg.quantize_mx(torch.stack([block(at_edge), block(above)]), "e4m3")
    assert q.scale.flatten().tolist() == [0, 1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_amax_is_taken_in_the_input_precision(dtype):
    x = block(448.1, 1.0)
    assert gg.quantize_mx(x, "e4m3").scale.tolist() == [128]
    low = x.to(dtype)
    assert low[0].item() == 448.0  # 448.1 rounds to 448 in bf16 and fp16
    assert gg.quantize_mx(low, "e4m3").scale.tolist() == [127]


def test_scale_decodes_as_powers_of_two():
    q = gg.MXTensor(
        data=torch.ones(3 * 32).to(torch.float8_e4m3fn),
        scale=torch.tensor([0, 127, 254], dtype=torch.uint8),
        fmt="e4m3",
        axis=0,
        shape=(96,),
    )
    deq = q.dequantize()
    assert deq[0].item() == 2.0**-127  # byte 0 is 2^-127, not zero
    assert deq[32].item() == 1.0
    assert deq[64].item() == 2.0**127


@pytest.mark.parametrize("rule", ["floor", "rceil", "even"])
def test_scale_rule_names_are_case_insensitive(rule):
    """The docs write FLOOR / RCEIL / EVEN; any case selects the same rule."""
    t = torch.randn(4, 64, generator=torch.Generator().manual_seed(5)) * 37.0
    lower = gg.quantize_mx(t, "e4m3", scale_rule=rule)
    for spelled in (rule.upper(), rule.capitalize()):
        other = gg.quantize_mx(t, "e4m3", scale_rule=spelled)
        assert torch.equal(other.scale, lower.scale) and torch.equal(other.data, lower.data)
    rows = gg.quantize_mx_rows(t, [3, 1], "e4m3", scale_rule=rule.upper())
    assert torch.equal(rows.tensor.scale, gg.quantize_mx_rows(t, [3, 1], "e4m3", scale_rule=rule).tensor.scale)


@pytest.mark.parametrize("bad", ["rceil ", "round", None, 1])
def test_unknown_scale_rule_is_named(bad):
    with pytest.raises(gg.InvalidArgumentError, match=r"scale_rule.*floor, rceil, even"):
        gg.quantize_mx(torch.ones(32), "e4m3", scale_rule=bad)
