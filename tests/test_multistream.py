"""``multistream``: what it declares (testable on the CPU) and its results on a GPU.

Accuracy rule: an fp32 result (fp32 operands, or bf16 / fp16 operands with an fp32
output, which cuBLAS computes and writes in fp32) must reach 60 dB SQNR against the
float64 reference; a bf16 / fp16 result its dtype's rounding floor (the SQNR of the
float64 reference rounded to that dtype) less 1 dB. GPU tests are marked ``gpu``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm.backends import multistream
from grouped_gemm.backends.multistream import ENV_STREAMS, MultistreamBackend
from grouped_gemm.backends.triton_mx import launch
from grouped_gemm.device import emulated
from grouped_gemm.dispatch import decide
from grouped_gemm.testing import poison, random_splits, ref_dgrad, ref_fwd, ref_wgrad, sqnr_db

NAME = "multistream"


def assert_accurate(got: torch.Tensor, expected: torch.Tensor) -> None:
    """60 dB for fp32 results, the dtype's own rounding floor (less 1 dB) otherwise."""
    floor = 60.0 if got.dtype == torch.float32 else sqnr_db(expected.to(got.dtype), expected) - 1.0
    assert sqnr_db(got, expected) >= floor


def assert_accumulated(got: torch.Tensor, base: torch.Tensor, increment: torch.Tensor) -> None:
    """fp32 buffers: 60 dB. bf16 buffers: cuBLAS's in-place bf16 addmm rounds the product
    and then the sum for small outputs (seen on H200 / torch 2.11, docs/backends.md), so
    the floor is that of exactly two roundings, less 1 dB."""
    expected = base.double() + increment
    if got.dtype == torch.float32:
        assert sqnr_db(got, expected) >= 60.0
        return
    rounded_twice = (base.double() + increment.to(got.dtype).double()).to(got.dtype)
    assert sqnr_db(got, expected) >= sqnr_db(rounded_twice, expected) - 1.0


def codes(**described) -> list[str]:
    described = {"op": "fwd", "groups": 32, "m": 16384, "n": 2048, "k": 1024, "device": "sm_90", **described}
    return [r.code for r in gg.explain(**described).candidate(NAME).reasons]


# ---------------------------------------------------------------- declared eligibility (CPU)


def test_cpu_tensors_are_not_its_business(gen):
    x, w = torch.randn(8, 16, generator=gen), torch.randn(2, 8, 16, generator=gen)
    assert "placement" in [r.code for r in gg.explain(x, w, [3, 5]).candidate(NAME).reasons]
    with emulated("sm_90"):
        reasons = gg.explain(x, w, [3, 5]).candidate(NAME).reasons
    assert [r.code for r in reasons] == ["placement"] and "cpu" in reasons[0].message


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_100", "sm_120", "gfx942", "gfx950"])
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
def test_eligible_on_every_gpu_for_plain_recipes(arch, op):
    for recipe in ("bf16", "fp16", "fp32"):
        assert codes(device=arch, op=op, recipe=recipe) == []
    assert codes(device=arch, op=op, device_splits=True) == []


def test_mx_recipes_are_declared_unsupported():
    for recipe in ("mxfp8", "mxfp4", "a8w4", "a16w4"):
        assert codes(recipe=recipe) == ["recipe"]


def test_output_dtypes():
    assert codes(out_dtype="float32") == []
    assert codes(recipe="fp16", out_dtype="float32") == []
    assert codes(recipe="fp16", out_dtype="bfloat16") == ["dtype"]
    assert codes(recipe="fp32", out_dtype="bfloat16") == ["dtype"]
    assert codes(op="wgrad", out_dtype="float32", accumulate=True) == []


def test_capture_is_refused_and_device_splits_name_the_sync():
    host = gg.describe_problem(op="fwd", groups=8, m=4096, n=1024, k=1024, device="sm_90")
    on_device = gg.describe_problem(op="fwd", groups=8, m=4096, n=1024, k=1024, device="sm_90", device_splits=True)
    host_reasons = decide(dataclasses.replace(host, capturing=True))[0].candidate(NAME).reasons
    device_reasons = decide(dataclasses.replace(on_device, capturing=True))[0].candidate(NAME).reasons
    assert [r.code for r in host_reasons] == ["capture"]
    assert [r.code for r in device_reasons] == ["capture", "capture"]
    assert "sync" in device_reasons[1].message


def test_ranks_below_the_grouped_kernels_and_takes_what_they_cannot_do(monkeypatch):
    """Below torch_grouped_mm and triton_grouped (judged as compiled Triton on a GPU judges
    it, not as this machine's interpreter), so it gets fp32 operands, unaligned N / K and
    archs neither declares."""
    monkeypatch.setattr(launch, "interpreted", lambda: False)

    def chosen(**described) -> str:
        described = {"op": "fwd", "groups": 32, "m": 16384, "n": 4096, "k": 7168, "device": "sm_90", **described}
        return gg.explain(**described).selected

    assert chosen() == "torch_grouped_mm"
    assert chosen(groups=8, n=28672, k=4096) == "torch_grouped_mm"
    for grouped in ({"recipe": "fp16"}, {"out_dtype": "float32"}, {"device": "sm_80"}):
        assert chosen(**grouped) == "triton_grouped"
    assert chosen(op="wgrad", out_dtype="float32", accumulate=True, device_splits=True) == "triton_grouped"
    # host splits, few large groups: per-group vendor GEMMs measured faster (H200)
    assert chosen(op="wgrad", out_dtype="float32", accumulate=True) == NAME
    assert chosen(recipe="fp32") == NAME
    assert chosen(device="sm_89") == NAME
    assert chosen(k=7004) == NAME


# ---------------------------------------------------------------- stream count configuration


@pytest.mark.parametrize("raw", ["0", "-1", "33", "four", "2.5", "1e9"])
def test_bad_stream_count_in_the_environment_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv(ENV_STREAMS, raw)
    with pytest.raises(gg.ConfigError, match=ENV_STREAMS) as info:
        MultistreamBackend()
    assert repr(raw) in str(info.value) and "1 to 32" in str(info.value)


def test_stream_count_from_environment_code_and_default(monkeypatch):
    monkeypatch.setenv(ENV_STREAMS, " 2 ")
    assert MultistreamBackend().streams == 2
    monkeypatch.delenv(ENV_STREAMS)
    assert MultistreamBackend().streams == multistream.DEFAULT_STREAMS == 4
    assert MultistreamBackend(streams=3).streams == 3
    backend = MultistreamBackend()
    backend.streams = 1
    assert backend.streams == 1
    for bad in (0, 33, "x", True):
        with pytest.raises(gg.ConfigError, match="streams"):
            backend.streams = bad


def test_set_streams_configures_the_registered_backend():
    before = multistream._BACKEND.streams
    try:
        multistream.set_streams(2)
        assert multistream._BACKEND.streams == 2
        with pytest.raises(gg.ConfigError, match="streams"):
            multistream.set_streams(0)
    finally:
        multistream.set_streams(before)


# ---------------------------------------------------------------- GPU: results


gpu = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SPLITS = {
    "empty-groups": [130, 0, 77, 0, 0, 301, 12],
    "G1": [257],
    "skewed": gg.skewed_splits(16, 4096),
    "G256": random_splits(256, 5000, empty=40, generator=torch.Generator().manual_seed(3)),
}


def operands(gen, splits, n, k, dtype):
    m = sum(splits)
    x = torch.randn(m, k, generator=gen).to("cuda", dtype)
    w = torch.randn(len(splits), n, k, generator=gen).to("cuda", dtype)
    dy = torch.randn(m, n, generator=gen).to("cuda", dtype)
    return x, w, dy


@pytest.fixture
def streams(request):
    """Run a test with ``set_streams(request.param)``, restoring the count afterwards."""
    before = multistream._BACKEND.streams
    multistream.set_streams(request.param)
    yield request.param
    multistream.set_streams(before)


def three_ops(x, w, dy, splits, *, out_dtype=None):
    """fwd, dgrad and wgrad forced onto multistream, into poisoned outputs, checked."""
    host = splits.tolist() if isinstance(splits, torch.Tensor) else list(splits)
    m, g, n, k = x.shape[0], len(host), dy.shape[1], x.shape[1]
    dtype = out_dtype or x.dtype
    with gg.use_backends(NAME, strict=True):
        out = gg.grouped_gemm(x, w, splits, out=poison(torch.empty(m, n, dtype=dtype, device="cuda")))
        assert_accurate(out, ref_fwd(x, w, host))
        dx = gg.grouped_gemm_dgrad(dy, w, splits, out=poison(torch.empty(m, k, dtype=dtype, device="cuda")))
        assert_accurate(dx, ref_dgrad(dy, w, host))
        dw = gg.grouped_gemm_wgrad(dy, x, splits, out=poison(torch.empty(g, n, k, dtype=dtype, device="cuda")))
        assert_accurate(dw, ref_wgrad(dy, x, host))
    assert all(torch.count_nonzero(dw[i]) == 0 for i, rows in enumerate(host) if rows == 0)


@gpu
@pytest.mark.parametrize("streams", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", SPLITS.values(), ids=SPLITS.keys())
def test_three_ops_match_float64(gen, streams, dtype, splits):
    x, w, dy = operands(gen, splits, 96, 160, dtype)
    three_ops(x, w, dy, splits)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_output_from_half_operands(gen, dtype):
    splits = [400, 0, 123, 999]
    x, w, dy = operands(gen, splits, 256, 128, dtype)
    three_ops(x, w, dy, splits, out_dtype=torch.float32)


@gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_wgrad_accumulates_in_place_and_skips_empty_groups(gen, out_dtype):
    splits = [640, 0, 1000, 0, 17]
    x, _, dy = operands(gen, splits, 192, 256, torch.bfloat16)
    base = torch.randn(5, 192, 256, generator=gen).to("cuda", out_dtype)
    out = base.clone()
    with gg.use_backends(NAME, strict=True):
        got = gg.grouped_gemm_wgrad(dy, x, splits, out=out, accumulate=True)
    assert got is out
    assert_accumulated(out, base, ref_wgrad(dy, x, splits))
    assert torch.equal(out[1], base[1]) and torch.equal(out[3], base[3])


@gpu
def test_weight_lists_and_per_expert_wgrad_buffers(gen):
    splits = [300, 0, 211, 89]
    x, w, dy = operands(gen, splits, 128, 64, torch.bfloat16)
    with gg.use_backends(NAME, strict=True):
        assert_accurate(gg.grouped_gemm(x, list(w), splits), ref_fwd(x, w, splits))
        assert_accurate(gg.grouped_gemm_dgrad(dy, list(w), splits), ref_dgrad(dy, w, splits))
        main_grads = [torch.randn(128, 64, generator=gen).cuda() for _ in splits]
        before = [t.clone() for t in main_grads]
        gg.grouped_gemm_wgrad(dy, x, splits, out=main_grads, accumulate=True)
    expected = torch.stack(before).double() + ref_wgrad(dy, x, splits)
    assert_accurate(torch.stack(main_grads), expected)
    assert torch.equal(main_grads[1], before[1])


@gpu
def test_device_splits_cost_one_sync_and_work(gen):
    splits = [500, 0, 250, 1250]
    x, w, dy = operands(gen, splits, 128, 256, torch.bfloat16)
    three_ops(x, w, dy, torch.tensor(splits, device="cuda"))


@gpu
def test_all_groups_empty(gen):
    x, w, dy = operands(gen, [0, 0, 0], 32, 64, torch.bfloat16)
    with gg.use_backends(NAME, strict=True):
        assert gg.grouped_gemm(x, w, [0, 0, 0]).shape == (0, 32)
        assert torch.count_nonzero(gg.grouped_gemm_wgrad(dy, x, [0, 0, 0])) == 0
        base = torch.randn(3, 32, 64, device="cuda")
        assert torch.equal(gg.grouped_gemm_wgrad(dy, x, [0, 0, 0], out=base.clone(), accumulate=True), base)


@gpu
def test_non_contiguous_operands(gen):
    splits = [200, 0, 301, 99]
    m, n, k = sum(splits), 96, 136
    x = torch.randn(k, m, generator=gen).to("cuda", torch.bfloat16).t()
    w = torch.randn(4, k, n, generator=gen).to("cuda", torch.bfloat16).transpose(1, 2)
    dy = torch.randn(m, n + 5, generator=gen).to("cuda", torch.bfloat16)[:, :n]
    three_ops(x, w, dy, splits)


@gpu
def test_caller_stream_ordering_and_memory_reuse(gen):
    """Inputs made on a non-default stream right before the call, freed right after, and
    their memory refilled on that stream: the result is still that of the original data."""
    splits = [3000, 0, 5000, 2000, 6000]
    caller = torch.cuda.Stream()
    with torch.cuda.stream(caller), gg.use_backends(NAME, strict=True):
        x = torch.randn(16000, 1024, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(5, 2048, 1024, device="cuda", dtype=torch.bfloat16)
        x_copy, w_copy = x.clone(), w.clone()
        out = gg.grouped_gemm(x, w, splits)
        del x, w
        junk = torch.full((16000 + 5 * 2048, 1024), float("nan"), device="cuda", dtype=torch.bfloat16)
    caller.synchronize()
    assert junk.isnan().all()
    assert_accurate(out, ref_fwd(x_copy, w_copy, splits))


@gpu
@pytest.mark.parametrize("streams", [1, 4], indirect=True)
@pytest.mark.parametrize(("n", "k"), [(1024, 4096), (4096, 1024)])
def test_moe_sizes(gen, streams, n, k):
    splits = gg.skewed_splits(32, 16384)
    splits[5] = 0
    splits[0] += 16384 - sum(splits)
    x, w, dy = operands(gen, splits, n, k, torch.bfloat16)
    three_ops(x, w, dy, splits)
    main_grad = torch.randn(32, n, k, generator=gen).cuda()
    before = main_grad.clone()
    with gg.use_backends(NAME, strict=True):
        gg.grouped_gemm_wgrad(dy, x, splits, out=main_grad, accumulate=True)
    assert_accurate(main_grad, before.double() + ref_wgrad(dy, x, splits))
