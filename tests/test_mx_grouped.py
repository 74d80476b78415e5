"""Grouped helpers: weights along K (fwd) and N (dgrad), token rows along M per group."""

from __future__ import annotations

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm.testing import random_splits, sqnr_db


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_weight_along_k_and_along_n_are_different_tensors(gen, fmt):
    w = torch.randn(3, 64, 96, generator=gen)
    fwd = gg.quantize_mx_weight(w, fmt)
    dgrad = gg.quantize_mx_weight(w, fmt, op="dgrad")
    assert (fwd.axis, fwd.scale.shape) == (2, (3, 64, 3))
    assert (dgrad.axis, dgrad.scale.shape) == (1, (3, 2, 96))
    assert torch.equal(fwd.scale, gg.quantize_mx(w, fmt, axis=-1).scale)
    assert torch.equal(dgrad.scale, gg.quantize_mx(w, fmt, axis=1).scale)
    # different blocks: the element codes differ wherever the two block scales do
    if fmt == "e4m3":
        assert not torch.equal(fwd.data.view(torch.uint8), dgrad.data.view(torch.uint8))
    assert sqnr_db(fwd.dequantize(), w) > 15 and sqnr_db(dgrad.dequantize(), w) > 15


def test_weight_list_is_stacked(gen):
    ws = [torch.randn(32, 64, generator=gen) for _ in range(4)]
    q = gg.quantize_mx_weight(ws, "e2m1", op="dgrad")
    assert torch.equal(q.data, gg.quantize_mx_weight(torch.stack(ws), "e2m1", op="dgrad").data)


def test_weight_errors(gen):
    with pytest.raises(gg.InvalidArgumentError, match=r"op='wgrad'.*'fwd'.*'dgrad'"):
        gg.quantize_mx_weight(torch.randn(2, 32, 32), "e2m1", op="wgrad")
    with pytest.raises(gg.ShapeError, match=r"w=.*\(G, N, K\)"):
        gg.quantize_mx_weight(torch.randn(32, 32), "e2m1")
    with pytest.raises(gg.ShapeError, match="multiple of block_size=32"):
        gg.quantize_mx_weight(torch.randn(2, 40, 64), "e4m3", op="dgrad")
    assert gg.quantize_mx_weight(torch.randn(2, 40, 64), "e4m3", op="dgrad", pad=True).pad == 24


def _per_group_reference(t, splits, fmt, align):
    """Each group quantized on its own along M after zero-padding to ``align`` rows."""
    parts, start = [], 0
    for rows in splits:
        g = t[start : start + rows]
        padded = -(-rows // align) * align
        block = torch.zeros(padded, t.shape[1], dtype=t.dtype)
        block[:rows] = g
        parts.append(gg.quantize_mx(block, fmt, axis=0) if padded else None)
        start += rows
    return parts


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("align", [32, 64])
@pytest.mark.parametrize(
    "splits", [[37, 0, 5, 90], [0, 0, 0], [32, 64], [1], "random"], ids=["skewed", "empty", "aligned", "one", "random"]
)
def test_rows_pad_each_group_and_keep_tight_offsets(gen, fmt, align, splits):
    if splits == "random":
        splits = random_splits(7, 300, empty=2, generator=gen)
    m = sum(splits)
    t = torch.randn(m, 48, generator=gen, dtype=torch.bfloat16)
    rows = gg.quantize_mx_rows(t, splits, fmt, align=align)
    padded = [-(-s // align) * align for s in splits]
    assert rows.padded_splits == padded and rows.m_splits == splits
    assert rows.offsets.tolist() == [0, *torch.tensor(splits).cumsum(0).tolist()]
    assert rows.padded_offsets.tolist() == [0, *torch.tensor(padded).cumsum(0).tolist()]
    assert rows.tensor.axis == 0 and rows.tensor.shape == (sum(padded), 48)
    assert rows.groups == len(splits)
    for g, want in enumerate(_per_group_reference(t, splits, fmt, align)):
        if want is None:
            continue
        lo, hi = rows.padded_offsets[g].item(), rows.padded_offsets[g + 1].item()
        assert torch.equal(rows.tensor.scale[lo // 32 : hi // 32], want.scale)
        per_byte = rows.tensor.format.per_byte
        got = rows.tensor.data[lo // per_byte : hi // per_byte].view(torch.uint8)
        assert torch.equal(got, want.data.view(torch.uint8))
    back = rows.dequantize()
    assert back.shape == t.shape
    if m:
        assert sqnr_db(back, t) > (15 if fmt == "e2m1" else 24)


def test_rows_keep_their_own_copy_of_host_splits(gen):
    """MXRows.m_splits was the caller's list: editing it after the call changed what the
    rows claimed to hold ([3, 7] became [5, 7] over rows quantized as [3, 7])."""
    t = torch.randn(10, 64, generator=gen)
    splits = [3, 7]
    rows = gg.quantize_mx_rows(t, splits, "e4m3")
    splits[0] = 5
    assert rows.m_splits == [3, 7] and rows.offsets.tolist() == [0, 3, 10]
    want = gg.quantize_mx(t[:3], "e4m3", axis=0, pad=True).dequantize(torch.float64)
    assert torch.equal(rows.dequantize(torch.float64)[:3], want)


def test_rows_refuse_offsets_written_in_place(gen):
    """Offsets whose sizes were edited in place (still summing to M) were quantized by the
    new sizes, while every GEMM call refuses them; now quantize_mx_rows refuses them too."""
    t = torch.randn(10, 64, generator=gen)
    offsets = gg.offsets([3, 7])
    offsets.splits[:] = torch.tensor([4, 6])
    with pytest.raises(gg.SplitsError, match=r"^m_splits=GroupOffsets.* is invalid: .*written in place"):
        gg.quantize_mx_rows(t, offsets, "e4m3")


def test_rows_accept_cpu_split_tensors(gen):
    t = torch.randn(50, 32, generator=gen)
    a = gg.quantize_mx_rows(t, torch.tensor([20, 30]), "e4m3")
    b = gg.quantize_mx_rows(t, [20, 30], "e4m3")
    assert torch.equal(a.tensor.data.view(torch.uint8), b.tensor.data.view(torch.uint8))
    assert a.padded_splits == [32, 32]


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"m_splits": [3, 4]}, gg.SplitsError, "summing to t.shape"),
        ({"m_splits": [-1, 11]}, gg.SplitsError, "non-negative"),
        ({"m_splits": [5.0, 5]}, gg.SplitsError, r"integers; m_splits\[0\]=5.0 is a float"),
        ({"m_splits": [10], "align": 48}, gg.InvalidArgumentError, "align=48"),
        ({"m_splits": [10], "fmt": "e3m2"}, gg.InvalidArgumentError, "fmt='e3m2'"),
        ({"m_splits": []}, gg.SplitsError, "at least one"),
    ],
)
def test_rows_errors(gen, kwargs, error, text):
    args = {"fmt": "e4m3", **kwargs}
    with pytest.raises(error, match=text):
        gg.quantize_mx_rows(torch.randn(10, 32, generator=gen), args.pop("m_splits"), args.pop("fmt"), **args)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_gpu_rows_match_cpu_and_device_splits_need_no_sync(fmt):
    gen = torch.Generator().manual_seed(9)
    splits = random_splits(16, 5000, empty=3, generator=gen)
    t = torch.randn(5000, 520, generator=gen, dtype=torch.bfloat16)
    cpu = gg.quantize_mx_rows(t, splits, fmt)
    gpu = gg.quantize_mx_rows(t.cuda(), splits, fmt)
    assert torch.equal(cpu.tensor.data.view(torch.uint8), gpu.tensor.data.cpu().view(torch.uint8))
    assert torch.equal(cpu.tensor.scale, gpu.tensor.scale.cpu())
    dev = gg.quantize_mx_rows(t.cuda(), torch.tensor(splits, device="cuda"), fmt)
    assert isinstance(dev.padded_splits, torch.Tensor) and dev.padded_splits.is_cuda
    assert torch.equal(dev.padded_offsets.cpu(), cpu.padded_offsets)
    total = cpu.tensor.shape[0]
    assert dev.tensor.shape[0] >= total
    assert torch.equal(
        dev.tensor.data[: total // cpu.tensor.format.per_byte].cpu().view(torch.uint8),
        cpu.tensor.data.view(torch.uint8),
    )
    assert (dev.tensor.scale[total // 32 :] == 0).all()


@pytest.mark.parametrize("splits", [[40, 0, 7, 33], [0], [5, 0]])
@pytest.mark.parametrize("align", [32, 64])
def test_padded_row_offsets_match_quantize_mx_rows(splits, align):
    """The layout ``quantize_mx_rows`` quantizes into, without quantizing: same offsets,
    padded offsets and padded row count, host splits or a tensor, device as a string."""
    t = torch.randn(sum(splits), 32)
    rows = gg.quantize_mx_rows(t, splits, "e4m3", align=align)
    for m_splits in (splits, torch.tensor(splits), gg.offsets(splits)):
        starts, padded_starts, padded_rows = gg.mx.padded_row_offsets(m_splits, sum(splits), "cpu", align)
        assert torch.equal(starts, rows.offsets) and torch.equal(padded_starts, rows.padded_offsets)
        assert padded_rows == rows.tensor.shape[0] and starts.dtype == padded_starts.dtype == torch.int32


@pytest.mark.parametrize(
    ("args", "name"),
    [
        (([32, 32], 63, "cpu"), "m_splits"),
        (([32, -1], 31, "cpu"), "m_splits"),
        (([32], 32.0, "cpu"), "rows"),
        (([32], -1, "cpu"), "rows"),
        (([32], 32, "nowhere"), "device"),
        (([32], 32, "cpu", 48), "align"),
    ],
)
def test_padded_row_offsets_names_bad_arguments(args, name):
    with pytest.raises(gg.GroupedGemmError, match=rf"\b{name}\b"):
        gg.mx.padded_row_offsets(*args)
