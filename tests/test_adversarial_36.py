"""Adversarial cases from the thirty-sixth hunt: group sizes of ``gg.backend.gmm`` /
``gg.ops.gmm``, memory shared through distinct storages (numpy / frombuffer aliases, a
layer's bias inside its out= buffer, meta tensors), decisions shared by a bucket of M,
device names of one device, lazily negated MX inputs. Each test failed before its fix;
CPU only, small shapes, fresh random data, float64 references.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import grouped_gemm as gg
from grouped_gemm import backend, ops
from grouped_gemm.registry import registry
from grouped_gemm.testing import ref_dgrad, ref_fwd, rel_error, sqnr_db

# ---- batch_sizes items of gmm -------------------------------------------------------------

BAD_BATCH_ITEMS = [
    ("bool_tensor", torch.tensor(True), r"batch_sizes\[0\] is a tensor of dtype torch\.bool"),
    ("meta_tensor", torch.tensor(1, device="meta"), r"batch_sizes\[0\] is a tensor of dtype torch\.int64 .* on meta"),
]


@pytest.mark.parametrize("gmm", [backend.gmm, ops.gmm], ids=["backend.gmm", "ops.gmm"])
@pytest.mark.parametrize(("label", "item", "message"), BAD_BATCH_ITEMS, ids=[c[0] for c in BAD_BATCH_ITEMS])
def test_gmm_batch_sizes_items_are_checked_like_m_splits(gmm, label, item, message, gen):
    """gmm's host sizes went through ``operator.index`` alone: a bool tensor item counted as
    one row (gg.grouped_gemm refuses it) and a meta tensor item raised torch's bare
    "Tensor.item() cannot be called on meta tensors". Now the items are checked as
    m_splits' are, naming batch_sizes and the item."""
    a = torch.randn(6, 4, generator=gen)
    b = torch.randn(2, 4, 3, generator=gen)
    with pytest.raises(gg.SplitsError, match=rf"^batch_sizes=.*{message}"):
        gmm(a, b, [item, 5])
    good = gmm(a, b, [np.int64(1), torch.tensor(5, dtype=torch.int32)])
    assert rel_error(good, ref_dgrad(a, b, [1, 5])) < 1e-6


# ---- memory shared through distinct storages ------------------------------------------------


def _two_views(rows: int, cols: int, shift: int, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Two (rows, cols) fp32 tensors over one buffer, the second ``shift`` elements later,
    each with its own storage (numpy views or torch.frombuffer)."""
    count = rows * cols
    if how == "numpy":
        buf = np.random.default_rng().standard_normal(count + shift).astype(np.float32)
        return torch.from_numpy(buf[:count]).view(rows, cols), torch.from_numpy(buf[shift:]).view(rows, cols)
    raw = bytearray((count + shift) * 4)
    first = torch.frombuffer(raw, dtype=torch.float32, count=count).view(rows, cols)
    second = torch.frombuffer(raw, dtype=torch.float32, count=count, offset=shift * 4).view(rows, cols)
    first.copy_(torch.randn(rows, cols))
    return first, second


@pytest.mark.parametrize("how", ["numpy", "frombuffer"])
def test_an_out_sharing_memory_with_an_input_through_another_storage_is_refused(how, gen):
    """The overlap check grouped tensors by storage: an out= made over x's buffer by numpy
    or torch.frombuffer (its own storage, same bytes) passed, and the reference backend
    overwrote rows of dy it had not read yet (relative error ~0.5 against float64). Now
    byte ranges are compared per device, whatever the storage, and out is named."""
    dy, out = _two_views(6, 4, 4, how)
    assert dy.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()
    w = torch.randn(2, 4, 4, generator=gen)
    expected = ref_dgrad(dy.clone(), w, [3, 3])
    with pytest.raises(gg.InvalidArgumentError, match=r"^out=.*shares no memory with the input dy"):
        gg.grouped_gemm_dgrad(dy, w, [3, 3], out=out, backend="reference")
    assert rel_error(gg.grouped_gemm_dgrad(dy, w, [3, 3], backend="reference"), expected) < 1e-6


def test_gmm_c_sharing_memory_with_a_through_another_storage_is_refused(gen):
    """gg.backend.gmm's c= check had the same same-storage test: a c made by numpy over a's
    buffer was written while a was read. Now refused, naming c."""
    a, c = _two_views(6, 4, 4, "numpy")
    b = torch.randn(2, 4, 4, generator=gen)
    with pytest.raises(gg.InvalidArgumentError, match=r"^c=.*does not overlap a"):
        backend.gmm(a, b, [3, 3], c=c)


def test_a_main_grad_sharing_memory_with_a_weight_through_another_storage_is_named(gen):
    """fused wgrad accumulation's aliasing check used the same test: a main_grad made by
    numpy over the weight's buffer passed and backward would add the gradient into the
    weight. Now named at forward."""
    w, alias = _two_views(4, 4, 2, "numpy")
    weight = torch.nn.Parameter(w.view(1, 4, 4))
    weight.main_grad = alias.view(1, 4, 4)
    x = torch.randn(3, 4, generator=gen)
    with pytest.raises(gg.InvalidArgumentError, match=r"^weight\.main_grad=.*overlaps weight"):
        gg.grouped_linear(x, weight, [3], fuse_wgrad_accumulation=True)
    assert rel_error(gg.grouped_gemm(x, w.view(1, 4, 4), [3]), ref_fwd(x, w.view(1, 4, 4), [3])) < 1e-6


# ---- decisions shared by a bucket of M ------------------------------------------------------

#: Pairs of group sizes whose problems share a signature (M in one power-of-two bucket, the
#: same largest-group bound and row alignment): a cached decision serves both.
SAME_BUCKET = [([2**30, 1, 1], [2**30, 2**30 - 1, 1]), ([16, 1, 1], [16, 15, 1])]


@pytest.mark.parametrize("device", ["cpu", "sm_90", "sm_100", "gfx950"])
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize("device_splits", [False, True])
def test_every_backend_judges_a_whole_bucket_of_m_alike(device, op, device_splits):
    """The dispatcher caches one decision per signature, M bucketed to a power of two, and
    problem.py asks every check to agree within a bucket. torch_grouped_mm refused only
    M > 2**31 - 1: a call with M=2**30+2 cached it, and a later M=2**31 of the same bucket
    ran it with int32 ends that overflow (torch's overflow error from host splits, a
    wrapped cumsum from device splits). Now it refuses the whole bucket, and every
    registered backend's check agrees on both members of each pair."""
    for small, large in SAME_BUCKET:
        problems = [
            gg.describe_problem(
                op=op, groups=3, m=sum(s), n=64, k=64, device=device, splits=s, device_splits=device_splits
            )
            for s in (small, large)
        ]
        assert problems[0].signature == problems[1].signature
        for entry in registry().entries():
            codes = [sorted(r.code for r in entry.backend.check(p)) for p in problems]
            assert codes[0] == codes[1], (entry.spec.name, small, large, codes)


# ---- device names of the same device ---------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu:0", torch.device("cpu", 0)], ids=["name", "torch.device"])
def test_offsets_already_on_the_named_device_are_returned(device, gen):
    """gg.offsets(offs, device=...) compared the parsed device with the offsets' own:
    ``cpu:0`` (or cuda without an index against cuda:0) is the same device but not an equal
    torch.device, so it was refused ("device='cpu:0' is invalid: cpu, where these offsets
    already live"). Devices are now compared as a tensor on them reports them."""
    sizes = torch.randint(0, 5, (4,), generator=gen).tolist()
    offs = gg.offsets(sizes)
    assert gg.offsets(offs, device=device) is offs
    x = torch.randn(sum(sizes), 8, generator=gen)
    w = torch.randn(4, 3, 8, generator=gen)
    moved = gg.offsets(torch.tensor(sizes), device=device)
    assert moved.device == torch.device("cpu")
    assert rel_error(gg.grouped_gemm(x, w, moved), ref_fwd(x, w, sizes)) < 1e-6


# ---- a layer's out= sharing memory with its bias -------------------------------------------


def test_a_layer_out_sharing_memory_with_its_bias_is_refused(gen):
    """grouped_linear / GroupedLinear(out=buf) with the (G, N) bias a view of buf: the GEMM
    checks out against x and w only, wrote buf, and the bias then added was the overwritten
    rows (relative error ~0.8 against float64). Now out is refused, naming the bias, before
    anything is written; a disjoint out still gets the right numbers."""
    sizes = [2, 4]
    x = torch.randn(6, 8, generator=gen)
    w = torch.randn(2, 4, 8, generator=gen)
    buf = torch.randn(6, 4, generator=gen)
    before = buf.clone()
    with pytest.raises(gg.InvalidArgumentError, match=r"^out=.*shares no memory with the input bias"):
        gg.grouped_linear(x, w, sizes, buf[:2], out=buf)
    assert torch.equal(buf, before)
    layer = gg.GroupedLinear(2, 8, 4, dtype=torch.float32)
    with torch.no_grad():
        layer.bias.data = buf[4:]
        with pytest.raises(gg.InvalidArgumentError, match=r"^out=.*shares no memory with the input bias"):
            layer(x, sizes, out=buf)
        out = torch.empty(6, 4)
        expected = ref_fwd(x, layer.weight, sizes) + layer.bias.double().repeat_interleave(torch.tensor(sizes), 0)
        assert rel_error(layer(x, sizes, out=out), expected) < 1e-6


# ---- lazily negated operands ---------------------------------------------------------------


def _negated_view(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """A real fp32 tensor carrying torch's negative bit, as public code makes one."""
    z = torch.complex(torch.randn(rows, cols, generator=gen), torch.randn(rows, cols, generator=gen))
    view = z.conj().imag
    assert view.is_neg() and view.dtype == torch.float32
    return view


def test_mx_quantization_of_a_negated_view_matches_the_resolved_tensor(gen):
    """``z.conj().imag`` is a real tensor with the negative bit set: the torch quantizer's
    ``.view(torch.int32)`` of it raised "view is not supported for tensors with negative bit
    set", out of gg.quantize_mx / quantize_mx_weight and as the reference backend's
    BackendRunError for an MX grouped_gemm. It is resolved first now: the same codes as
    the resolved copy, and the MX product of the true values."""
    x = _negated_view(64, 32, gen)
    resolved = x.resolve_neg()
    for axis in (0, 1):
        got, want = gg.quantize_mx(x, "e4m3", axis=axis), gg.quantize_mx(resolved, "e4m3", axis=axis)
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scale, want.scale)
    w_view = _negated_view(64, 32, gen).view(2, 32, 32)
    assert torch.equal(gg.quantize_mx_weight(w_view, "e2m1").data, gg.quantize_mx_weight(w_view.clone(), "e2m1").data)
    w = torch.randn(2, 16, 32, generator=gen)
    sizes = [40, 24]
    y = gg.grouped_gemm(x, w, sizes, recipe="mxfp8", backend="reference")
    assert torch.equal(y, gg.grouped_gemm(resolved, w, sizes, recipe="mxfp8", backend="reference"))
    assert sqnr_db(y, ref_fwd(resolved, w, sizes)) > 25


def test_a_meta_layer_with_fused_accumulation_is_refused_for_its_meta_input():
    """Every meta tensor's data pointer is 0, so the overlap check found each main_grad
    "overlapping" its meta weight and refused weight.main_grad (it shares no memory: there
    is none). Meta tensors are skipped there now, and the call is refused for what is
    wrong with it: a meta input, named as x."""
    layer = gg.GroupedLinear(2, 4, 3, device="meta", dtype=torch.float32, fuse_wgrad_accumulation=True)
    layer.weight.main_grad = torch.empty(2, 3, 4, device="meta")
    with pytest.raises(gg.DeviceMismatchError, match=r"^x=.*meta tensors have none"):
        layer(torch.empty(5, 4, device="meta"), [2, 3])
