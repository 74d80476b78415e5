"""Adversarial cases from the hunt over the thirty-second session's changes (the two-height
upcast schedule, ``GroupOffsets.written``'s fast path, the validation / dispatch fast paths,
autocast, host splits under a non-CPU default device). Each test failed before its fix;
CPU only, small shapes, fresh random data, float64 references, poisoned outputs.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm.testing import poison, random_splits, ref_fwd, ref_wgrad, rel_error

G, N, K = 3, 8, 16
SPLITS = [3, 0, 5]
M = sum(SPLITS)


@pytest.fixture(autouse=True)
def _quiet_sparse():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sparse CSR tensor support", UserWarning)
        yield


# ---- sparse (COO) group-size tensors ---------------------------------------------------------


def _sparse(values: list[int]) -> torch.Tensor:
    return torch.tensor(values).to_sparse()


SPARSE_SPLITS_CALLS = {
    "fwd": lambda x, w, dy, s, out: gg.grouped_gemm(x, w, s, out=out["fwd"]),
    "dgrad": lambda x, w, dy, s, out: gg.grouped_gemm_dgrad(dy, w, s, out=out["dgrad"]),
    "wgrad": lambda x, w, dy, s, out: gg.grouped_gemm_wgrad(dy, x, s, out=out["wgrad"]),
    "wgrad_accumulate": lambda x, w, dy, s, out: gg.grouped_gemm_wgrad(dy, x, s, out=out["wgrad"], accumulate=True),
}


@pytest.mark.parametrize("op", list(SPARSE_SPLITS_CALLS))
def test_sparse_m_splits_tensor_is_named_and_nothing_is_written(op, gen):
    """A 1-D sparse COO integer m_splits passed the rank and dtype checks and failed in
    torch's ``tolist`` ("Cannot access data pointer of Tensor that doesn't have storage"),
    naming no argument; now a SplitsError naming m_splits and its layout, before any
    output is written. The same sizes as a dense tensor give the float64 answer."""
    x = torch.randn(M, K, generator=gen)
    w = torch.randn(G, N, K, generator=gen)
    dy = torch.randn(M, N, generator=gen)
    out = {
        "fwd": poison(torch.empty(M, N)),
        "dgrad": poison(torch.empty(M, K)),
        "wgrad": poison(torch.empty(G, N, K)),
    }
    with pytest.raises(gg.SplitsError, match=r"^m_splits=.*sparse_coo"):
        SPARSE_SPLITS_CALLS[op](x, w, dy, _sparse(SPLITS), out)
    assert all(torch.isnan(t).all() for t in out.values()), "a refused call wrote its out="
    if op == "fwd":
        got = SPARSE_SPLITS_CALLS[op](x, w, dy, torch.tensor(SPLITS), out)
        assert rel_error(got, ref_fwd(x, w, SPLITS)) < 1e-5
    if op == "wgrad":
        got = SPARSE_SPLITS_CALLS[op](x, w, dy, torch.tensor(SPLITS), out)
        assert rel_error(got, ref_wgrad(dy, x, SPLITS)) < 1e-5


def test_sparse_m_splits_tensor_is_named_by_the_layer_and_quantize_mx_rows(gen):
    """The same torch error came out of GroupedLinear's forward and quantize_mx_rows."""
    layer = gg.GroupedLinear(G, K, N, recipe="fp32")
    x = torch.randn(M, K, generator=gen)
    with pytest.raises(gg.SplitsError, match=r"^m_splits=.*sparse_coo"):
        layer(x, _sparse(SPLITS))
    with pytest.raises(gg.SplitsError, match=r"^m_splits=.*sparse_coo"):
        gg.quantize_mx_rows(torch.randn(64, 32, generator=gen), _sparse([32, 0, 32]), "e4m3")


@pytest.mark.parametrize("part", ["splits", "ends"])
def test_hand_built_group_offsets_with_a_sparse_part_is_named(part):
    """``GroupOffsets(splits, ends, total)`` built by hand with a sparse part failed in
    torch's cumsum / equal (NotImplementedError for the SparseCPU backend); now a
    SplitsError naming the part."""
    parts = {"splits": torch.tensor(SPLITS, dtype=torch.int32), "ends": torch.tensor([3, 3, 8], dtype=torch.int32)}
    parts[part] = parts[part].to_sparse()
    with pytest.raises(gg.SplitsError, match=rf"^{part}=.*sparse_coo"):
        gg.GroupOffsets(parts["splits"], parts["ends"], None)


# ---- split generators under a non-CPU default device -----------------------------------------


def test_split_generators_under_a_meta_default_device():
    """``gg.skewed_splits`` (and ``testing.random_splits``) drew their sizes on torch's
    default device: under ``torch.device("meta")`` (or a GPU default) they failed inside
    torch ("Tensor.item() cannot be called on meta tensors"; a CPU generator on a GPU
    default device: "Expected a 'cuda' device type for generator"). Host sizes are drawn
    on the CPU, so they match the sizes drawn outside the block."""
    want_skewed = gg.skewed_splits(7, 1000, seed=5)
    want_random = random_splits(6, 500, empty=2, generator=torch.Generator().manual_seed(9))
    with torch.device("meta"):
        assert gg.skewed_splits(7, 1000, seed=5) == want_skewed
        assert random_splits(6, 500, empty=2, generator=torch.Generator().manual_seed(9)) == want_random
        sizes = random_splits(4, 100)
    assert sum(want_skewed) == 1000 and sum(sizes) == 100 and len(sizes) == 4


# ---- a meta operand beside operands with data --------------------------------------------------


def _meta_calls(gen: torch.Generator) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, object]]]:
    """The poisoned out= buffers, and per call the meta argument's name and the call with
    only that operand on meta."""
    x, w = torch.randn(M, K, generator=gen), torch.randn(G, N, K, generator=gen)
    meta_x, meta_dy = torch.empty(M, K, device="meta"), torch.empty(M, N, device="meta")
    outs = {"fwd": poison(torch.empty(M, N)), "dgrad": poison(torch.empty(M, K)), "wgrad": poison(torch.empty(G, N, K))}
    layer = gg.GroupedLinear(G, K, N, recipe="fp32")
    return outs, {
        "fwd": ("x", lambda: gg.grouped_gemm(meta_x, w, SPLITS, out=outs["fwd"])),
        "dgrad": ("dy", lambda: gg.grouped_gemm_dgrad(meta_dy, w, SPLITS, out=outs["dgrad"])),
        "wgrad": ("dy", lambda: gg.grouped_gemm_wgrad(meta_dy, x, SPLITS, out=outs["wgrad"])),
        "grouped_linear": ("x", lambda: gg.grouped_linear(meta_x, w, SPLITS)),
        "layer_with_bias": ("x", lambda: layer(meta_x, SPLITS)),
        "backend_gmm": ("a", lambda: gg.backend.gmm(meta_x, w, SPLITS, trans_b=True, c=outs["fwd"])),
        "backend_gmm_trans_a": ("a", lambda: gg.backend.gmm(meta_dy, x, SPLITS, trans_a=True)),
        "ops_gmm": ("a", lambda: gg.ops.gmm(meta_x, w, torch.tensor(SPLITS), trans_b=True)),
    }


@pytest.mark.parametrize(
    "call",
    ["fwd", "dgrad", "wgrad", "grouped_linear", "layer_with_bias", "backend_gmm", "backend_gmm_trans_a", "ops_gmm"],
)
def test_a_meta_operand_is_named_not_the_operand_with_data(call, gen):
    """With x (dy, a) on meta and the other operand on the CPU, the error named the CPU
    operand (or the layer's own bias) and asked for it on meta: 'w=Tensor(..., device=cpu)
    is invalid: a tensor on meta, like the other operands' (the meta refusals of
    de56450 / d8dc7a5 ran only after the device comparison). Now the meta operand is the one
    named; nothing is written."""
    outs, calls = _meta_calls(gen)
    name, fn = calls[call]
    with pytest.raises(gg.DeviceMismatchError, match=rf"^{name}=Tensor\(.*device=meta\) is invalid"):
        fn()
    assert all(torch.isnan(t).all() for t in outs.values()), "a refused call wrote its out="


@pytest.mark.gpu
def test_gpu_sparse_device_m_splits_are_named_by_quantize_mx_rows(gen):
    """quantize_mx_rows' device-splits branch tested rank and dtype only, so a sparse GPU
    tensor went on to ``.to(device)`` and failed later inside torch, naming no argument."""
    t = torch.randn(64, 32, generator=gen).cuda()
    splits = torch.tensor([32, 0, 32], device="cuda").to_sparse()
    with pytest.raises(gg.SplitsError, match=r"^m_splits=.*sparse_coo"):
        gg.quantize_mx_rows(t, splits, "e4m3")


def test_the_cpu_kernel_probe_runs_on_the_cpu_under_another_default_device(monkeypatch):
    """``torch_grouped_mm`` asks once per process whether torch has a CPU kernel, by calling
    it on small tensors; those were built on torch's default device, so a first check under
    ``torch.device("meta")`` (or a GPU default) probed that device and kept its answer for
    the CPU."""
    from grouped_gemm.backends import torch_grouped_mm

    seen: list[torch.device] = []

    def recording(a, b, offs=None):
        seen.extend([a.device, b.device, offs.device])

    monkeypatch.setattr(torch_grouped_mm, "_GROUPED_MM", recording)
    torch_grouped_mm._cpu_kernel_error.cache_clear()
    try:
        with torch.device("meta"):
            assert torch_grouped_mm._cpu_kernel_error() is None
    finally:
        torch_grouped_mm._cpu_kernel_error.cache_clear()
    assert seen and all(d.type == "cpu" for d in seen), seen
