"""The fused Triton quantizer equals the torch quantizer bit for bit.

On a CPU machine the kernels run in Triton's interpreter, which Triton only enables for
a process that sets TRITON_INTERPRET=1 before importing it: ``test_interpreter_suite``
reruns this file in such a process (the interpreter tests skip themselves elsewhere).
On a GPU the ``gpu`` tests compare the compiled kernels at larger sizes.
"""

from __future__ import annotations

import math
import os
import pathlib
import struct
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import grouped_gemm as gg
from grouped_gemm.mx import torch_quantizer, triton_quantizer
from grouped_gemm.mx.formats import FORMATS

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess")
RULES = ("floor", "rceil", "even")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def assert_same(a: gg.MXTensor, b: gg.MXTensor) -> None:
    assert (a.fmt, a.axis, a.shape, a.pad, a.block_size) == (b.fmt, b.axis, b.shape, b.pad, b.block_size)
    assert a.data.dtype == b.data.dtype
    assert a.data.shape == b.data.shape and a.scale.shape == b.scale.shape
    sa, sb = a.scale.cpu(), b.scale.cpu()
    assert torch.equal(sa, sb), f"scales differ at {(sa != sb).nonzero()[:8].tolist()}"
    da, db = a.data.cpu().view(torch.uint8), b.data.cpu().view(torch.uint8)
    where = (da != db).nonzero()[:8].tolist()
    assert torch.equal(da, db), (
        f"elements differ at {where}: {[(da[tuple(i)].item(), db[tuple(i)].item()) for i in where]}"
    )


def both(t: torch.Tensor, fmt: str, axis: int = -1, rule: str = "rceil", pad: bool = False, block_size: int = 32):
    f = FORMATS[fmt]
    axis %= t.dim()
    missing = -t.shape[axis] % block_size if pad else 0
    want = torch_quantizer.quantize(t.cpu(), f, axis, rule, block_size, missing)
    got = triton_quantizer.quantize(t, f, axis, rule, block_size, missing)
    return want, got


def edge_blocks(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Blocks of 32 holding every golden edge case, one case per block."""
    cases = [
        [0.0],
        [-0.0],
        [2.0**-126] * 32,
        [f32(0x00000300), -f32(0x00000001)],
        [448.0, 1.0],
        [f32(0x43E00001), -3.0],
        [57344.0, 57345.0],
        [f32(0x7F7FFFFF), 1.0],
        [-f32(0x7F7FFFFF), f32(0x00800000)],
        [1.0, math.nan],
        [math.inf, 2.0],
        [-math.inf],
        [6.0, 0.25, 0.75, 1.25, -1.25, 2.5, 5.0, 1.75, 3.5, -0.25, f32(0x40600001), f32(0x405FFFFF)],
        [7.0, 1.0],
        [496.0, 17.0, 19.0, 272.0],
        [(7 * 2**21 + 1) * 2.0**-142],
        [(7 * 2**21 + 2) * 2.0**-142],
        [(3 * 2**22 + 1) * 2.0**-148],
        [3.5 * 2.0**-120, 2.0**-133],
        [1e-40, -1e-41],
    ]
    rows = []
    for values in cases:
        row = torch.zeros(32, dtype=torch.float64)
        row[: len(values)] = torch.tensor(values, dtype=torch.float64)
        rows.append(row.to(torch.float32))
    return torch.stack(rows).to(dtype)


@interpreted
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_cases(fmt, rule, dtype):
    x = edge_blocks(dtype if dtype != torch.float16 else torch.float32)
    if dtype == torch.float16:  # fp16 cannot hold most of these; keep what it can
        x = torch.nan_to_num(x.clamp(-60000, 60000), nan=math.nan).to(torch.float16)
    assert_same(*both(x.reshape(-1), fmt, rule=rule))
    assert_same(*both(x, fmt, rule=rule))
    assert_same(*both(x.T.contiguous(), fmt, axis=0, rule=rule))


@interpreted
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("shape", "axis", "pad"),
    [
        ((7, 96), -1, False),
        ((5, 70), -1, True),
        ((4, 33), -1, True),
        ((64, 9), 0, False),
        ((3, 40, 6), 1, True),
        ((2, 3, 64), 2, False),
    ],
)
def test_random_data(fmt, rule, dtype, shape, axis, pad):
    gen = torch.Generator().manual_seed(hash((fmt, rule, shape)) % 2**31)
    spread = torch.exp2(torch.randint(-30, 30, shape, generator=gen).float())
    x = (torch.randn(shape, generator=gen) * spread).to(dtype)
    assert_same(*both(x, fmt, axis=axis, rule=rule, pad=pad))


@interpreted
@pytest.mark.parametrize("block_size", [2, 8, 16, 64])
def test_other_block_sizes(block_size):
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(3))
    for fmt in FORMATS:
        assert_same(*both(x, fmt, block_size=block_size))
        assert_same(*both(x, fmt, axis=0, block_size=block_size, pad=True))


@interpreted
@settings(max_examples=30, deadline=None)
@given(
    bits=st.lists(st.integers(0, 2**32 - 1), min_size=64, max_size=64),
    fmt=st.sampled_from(["e4m3", "e5m2", "e2m1"]),
    rule=st.sampled_from(RULES),
)
def test_arbitrary_bit_patterns(bits, fmt, rule):
    x = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    assert_same(*both(x, fmt, rule=rule))
    assert_same(*both(x.reshape(32, 2), fmt, axis=0, rule=rule))


def padded_rows(x: torch.Tensor, sizes: list[int], align: int, total: int) -> torch.Tensor:
    """Each group's rows of ``x`` followed by zero rows up to a multiple of ``align``, then
    zero rows up to ``total``: what ``quantize_rows`` reads in place, built row by row."""
    zero = x.new_zeros(x.shape[1])
    rows, start = [], 0
    for size in sizes:
        rows += [x[start + r] for r in range(size)] + [zero] * (-size % align)
        start += size
    rows += [zero] * (total - len(rows))
    return torch.stack(rows)


def row_starts(sizes: list[int], align: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    tight, padded = [0], [0]
    for size in sizes:
        tight.append(tight[-1] + size)
        padded.append(padded[-1] + -(-size // align) * align)
    as_tensor = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    return as_tensor(tight), as_tensor(padded)


@interpreted
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize(
    ("sizes", "align", "extra"),
    [([3, 0, 36], 32, 0), ([0], 32, 64), ([5], 64, 0), ([40, 0, 0, 1, 70, 0], 32, 96), ([0, 0, 33], 64, 32)],
)
def test_grouped_rows_read_in_place(fmt, sizes, align, extra):
    """Every padded row of every group, empty groups, and zero rows past the last group
    (device splits size the output by a bound) against torch on the rows gathered by hand."""
    x = torch.randn(sum(sizes), 24, generator=torch.Generator().manual_seed(5))
    starts, padded_starts = row_starts(sizes, align)
    total = int(padded_starts[-1]) + extra
    got = triton_quantizer.quantize_rows(x, starts, padded_starts, total, FORMATS[fmt], "rceil", 32)
    gathered = padded_rows(x, sizes, align, total)
    assert_same(torch_quantizer.quantize(gathered, FORMATS[fmt], 0, "rceil", 32, 0), got)


@interpreted
def test_grouped_rows_stay_inside_bad_splits():
    """Starts past the input's rows (device splits that sum past M, caught only by an
    asynchronous assert) or before row 0: the kernel reads no row outside the input. The
    input is a view inside a larger tensor whose other rows are huge, so a read outside it
    would change the scales."""
    big = torch.full((140, 24), 1e30)
    big[50:90] = torch.randn(40, 24, generator=torch.Generator().manual_seed(6))
    x = big[50:90]
    padded_starts = torch.tensor([0, 32, 96], dtype=torch.int32)
    want = gg.quantize_mx_rows(x, [30, 10], "e4m3").tensor.dequantize()  # the rows inside x
    for starts in ([0, 30, 90], [0, -64, -30]):
        got = triton_quantizer.quantize_rows(
            x, torch.tensor(starts, dtype=torch.int32), padded_starts, 96, FORMATS["e4m3"], "rceil", 32
        ).dequantize()
        assert got.abs().max() < 1e4
        if starts[1] > 0:
            assert torch.equal(got[:64], want)


# Launch shapes of benchmarks/quantize_mx.py's sweep: (blocks, rows, warps) along the last
# axis, (inner, blocks, warps) along axis 0.
TILES = {-1: [(8, 16, 2), (32, 4, 4), (16, 8, 4)], 0: [(32, 8, 8), (64, 2, 1), (128, 4, 4)]}


@interpreted
@pytest.mark.parametrize("axis", [-1, 0])
def test_launch_shapes(axis):
    x = torch.randn(96, 160, generator=torch.Generator().manual_seed(7)) * 100
    x[5, 7] = math.inf
    for fmt in ("e4m3", "e2m1"):
        want = torch_quantizer.quantize(x, FORMATS[fmt], axis % 2, "rceil", 32, 0)
        for tile in TILES[axis]:
            assert_same(want, triton_quantizer.quantize(x, FORMATS[fmt], axis % 2, "rceil", 32, 0, tile=tile))


@interpreted
def test_empty_tensors():
    for shape, axis in (((0, 64), -1), ((64, 0), 0), ((0, 3, 32), 2), ((4, 0, 5), 1), ((2, 64, 0), 1)):
        assert_same(*both(torch.empty(shape), "e2m1", axis=axis))


def test_cpu_tensors_need_the_interpreter():
    if INTERPRETED:
        pytest.skip("this process interprets")
    with pytest.raises(gg.DeviceMismatchError, match="TRITON_INTERPRET=1"):
        triton_quantizer.quantize(torch.zeros(32), FORMATS["e4m3"], 0, "rceil", 32, 0)


def test_interpreter_suite():
    """Run this file's interpreter tests in a TRITON_INTERPRET=1 process."""
    if INTERPRETED:
        pytest.skip("already in the interpreter process")
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", str(pathlib.Path(__file__))]
    result = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


# ---- compiled kernels on a GPU ---------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_large_random(fmt, rule, dtype):
    gen = torch.Generator().manual_seed(11)
    shape = (1037, 4096 + 96)
    spread = torch.exp2(torch.randint(-40, 40, shape, generator=gen).float())
    x = (torch.randn(shape, generator=gen) * spread).to(dtype)
    x.view(-1)[::100003] = math.nan
    xc = x.cuda()
    assert_same(*both(xc, fmt, rule=rule))
    assert_same(*both(xc, fmt, axis=0, rule=rule, pad=True))
    assert_same(*both(xc[:, :4000], fmt, rule=rule, pad=True))
    w = xc[:1024].reshape(4, 256, 4192)
    assert_same(*both(w, fmt, axis=1, rule=rule))
    assert_same(gg.quantize_mx(x, fmt, scale_rule=rule), gg.quantize_mx(xc, fmt, scale_rule=rule))


@pytest.mark.gpu
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
def test_gpu_edge_cases_and_all_bit_patterns(fmt, rule):
    edges = edge_blocks().cuda()
    assert_same(*both(edges, fmt, rule=rule))
    assert_same(*both(edges.T.contiguous(), fmt, axis=0, rule=rule))
    # every fp32 bit pattern with 16 low bits fixed: all exponents, signs, NaNs, Infs
    high = torch.arange(2**16, dtype=torch.int64) << 16
    for low in (0, 0x8000, 0xFFFF, 0x1234):
        x = (high | low).to(torch.int32).view(torch.float32).cuda()
        assert_same(*both(x, fmt, rule=rule))
        assert_same(*both(x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(low))], fmt, rule=rule))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_gpu_launch_shapes(fmt):
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(1024, 4192 + 32, generator=gen).to(torch.bfloat16)
    x.view(-1)[::70001] = math.inf
    xc = x.cuda()
    for axis in (-1, 0):
        want = torch_quantizer.quantize(x, FORMATS[fmt], axis % 2, "rceil", 32, 0)
        for tile in TILES[axis]:
            got = triton_quantizer.quantize(xc, FORMATS[fmt], axis % 2, "rceil", 32, 0, tile=tile)
            assert_same(want, got)


@pytest.mark.gpu
def test_gpu_grouped_rows():
    """128 skewed groups, a fifth of them empty, with the bound's extra zero rows."""
    gen = torch.Generator().manual_seed(2)
    sizes = (torch.rand(128, generator=gen) ** 3 * 60).long()
    sizes[torch.randint(0, 128, (26,), generator=gen)] = 0
    sizes = sizes.tolist()
    x = torch.randn(sum(sizes), 520, generator=gen)
    starts, padded_starts = row_starts(sizes, 32, "cuda")
    total = int(padded_starts[-1]) + 96
    gathered = padded_rows(x, sizes, 32, total)
    for fmt in FORMATS:
        got = triton_quantizer.quantize_rows(x.cuda(), starts, padded_starts, total, FORMATS[fmt], "rceil", 32)
        assert_same(torch_quantizer.quantize(gathered, FORMATS[fmt], 0, "rceil", 32, 0), got)
