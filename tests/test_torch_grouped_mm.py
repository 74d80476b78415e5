"""``torch_grouped_mm`` against float64 math, and what it declares on each device.

Accuracy rule: torch._grouped_mm writes the input dtype, so an fp32 result must reach
60 dB SQNR against the float64 reference and a bf16 / fp16 result the rounding floor of
its dtype (the SQNR of the float64 reference rounded to that dtype) less 1 dB.
CPU tests run torch's composite CPU kernel; GPU tests (marked ``gpu``) run the CUTLASS
kernel, at MoE sizes and under CUDA-graph capture.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm.backends.torch_grouped_mm import TorchGroupedMMBackend, _clear_empty_groups, _row_major
from grouped_gemm.dispatch import decide
from grouped_gemm.testing import poison, random_splits, ref_dgrad, ref_fwd, ref_wgrad, sqnr_db

NAME = "torch_grouped_mm"
EDGE_SPLITS = [[0, 0, 0], [300], random_splits(256, 4099, empty=30, generator=torch.Generator().manual_seed(7))]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def assert_accurate(got: torch.Tensor, expected: torch.Tensor) -> None:
    """60 dB for fp32 results, the dtype's own rounding floor (less 1 dB) otherwise."""
    floor = 60.0 if got.dtype == torch.float32 else sqnr_db(expected.to(got.dtype), expected) - 1.0
    assert sqnr_db(got, expected) >= floor


def assert_accumulated(got: torch.Tensor, base: torch.Tensor, increment: torch.Tensor) -> None:
    """Accumulating into a bf16 buffer rounds twice: the bf16 result of torch._grouped_mm,
    then the sum. The floor is that of exactly those two roundings (less 1 dB)."""
    expected = base.double() + increment
    rounded_twice = (base.double() + increment.to(got.dtype).double()).to(got.dtype)
    assert sqnr_db(got, expected) >= sqnr_db(rounded_twice, expected) - 1.0


def operands(gen, splits, n, k, dtype, device="cpu"):
    m = sum(splits)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = torch.randn(len(splits), n, k, generator=gen).to(device, dtype)
    dy = torch.randn(m, n, generator=gen).to(device, dtype)
    return x, w, dy


def run_three_ops(x, w, dy, splits):
    """fwd, dgrad and wgrad through the public API into poisoned outputs, checked."""
    m, g, n, k = x.shape[0], w.shape[0], w.shape[1], w.shape[2]
    with gg.use_backends(NAME, strict=True):
        out = gg.grouped_gemm(x, w, splits, out=poison(x.new_empty(m, n)))
        assert_accurate(out, ref_fwd(x, w, _host(splits)))
        dx = gg.grouped_gemm_dgrad(dy, w, splits, out=poison(x.new_empty(m, k)))
        assert_accurate(dx, ref_dgrad(dy, w, _host(splits)))
        dw = gg.grouped_gemm_wgrad(dy, x, splits, out=poison(x.new_empty(g, n, k)))
        assert_accurate(dw, ref_wgrad(dy, x, _host(splits)))
    for group, rows in enumerate(_host(splits)):
        if rows == 0:
            assert torch.count_nonzero(dw[group]) == 0
    return out, dx, dw


def _host(splits):
    return splits.tolist() if isinstance(splits, torch.Tensor) else list(splits)


# ---------------------------------------------------------------- CPU: torch's composite kernel

SPLITS = {
    "G1": [40],
    "empty-groups": [7, 0, 13, 0, 0, 21, 3],
    "first-last-empty": [0, 9, 30, 0],
    "skewed": gg.skewed_splits(16, 512),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", SPLITS.values(), ids=SPLITS.keys())
def test_three_ops_match_float64_on_cpu(gen, dtype, splits):
    x, w, dy = operands(gen, splits, 24, 40, dtype)
    run_three_ops(x, w, dy, splits)


def test_many_groups_and_unaligned_rows(gen):
    splits = random_splits(256, 1001, empty=40, generator=gen)
    x, w, dy = operands(gen, splits, 16, 8, torch.bfloat16)
    run_three_ops(x, w, dy, splits)


def test_selected_by_default_on_cpu_above_reference_only(gen):
    x, w, _ = operands(gen, [3, 5], 8, 8, torch.bfloat16)
    decision = gg.explain(x, w, [3, 5])
    assert decision.candidate(NAME).eligible
    assert decision.candidate(NAME).priority == 5
    assert decision.candidate("reference").priority < 5
    assert gg.explain(op="fwd", groups=8, m=1024, n=64, k=64, device="sm_90").candidate(NAME).priority == 50


def test_all_groups_empty(gen):
    x, w, dy = operands(gen, [0, 0, 0], 16, 8, torch.bfloat16)
    with gg.use_backends(NAME, strict=True):
        assert gg.grouped_gemm(x, w, [0, 0, 0]).shape == (0, 16)
        assert gg.grouped_gemm_dgrad(dy, w, [0, 0, 0]).shape == (0, 8)
        dw = gg.grouped_gemm_wgrad(dy, x, [0, 0, 0], out=poison(torch.empty(3, 16, 8, dtype=torch.bfloat16)))
        assert torch.count_nonzero(dw) == 0
        base = torch.randn(3, 16, 8, generator=gen).bfloat16()
        kept = gg.grouped_gemm_wgrad(dy, x, [0, 0, 0], out=base.clone(), accumulate=True)
        assert torch.equal(kept, base)


def test_wgrad_accumulate_leaves_empty_groups_untouched(gen):
    splits = [11, 0, 25, 0, 8]
    x, _, dy = operands(gen, splits, 16, 24, torch.bfloat16)
    base = torch.randn(5, 16, 24, generator=gen).bfloat16()
    out = base.clone()
    with gg.use_backends(NAME, strict=True):
        got = gg.grouped_gemm_wgrad(dy, x, splits, out=out, accumulate=True)
    assert got is out
    assert_accumulated(got, base, ref_wgrad(dy, x, splits))
    assert torch.equal(got[1], base[1]) and torch.equal(got[3], base[3])


def test_wgrad_into_a_list_of_per_expert_buffers(gen):
    splits = [6, 0, 10]
    x, _, dy = operands(gen, splits, 8, 16, torch.float32)
    outs = [poison(torch.empty(8, 16)) for _ in splits]
    with gg.use_backends(NAME, strict=True):
        got = gg.grouped_gemm_wgrad(dy, x, splits, out=outs)
        assert got is not None and all(a is b for a, b in zip(got, outs, strict=True))
        assert_accurate(torch.stack(outs), ref_wgrad(dy, x, splits))
        base = [torch.randn(8, 16, generator=gen) for _ in splits]
        acc = [b.clone() for b in base]
        gg.grouped_gemm_wgrad(dy, x, splits, out=acc, accumulate=True)
    expected = torch.stack(base).double() + ref_wgrad(dy, x, splits)
    assert_accurate(torch.stack(acc), expected)
    assert torch.equal(acc[1], base[1])


def test_weight_lists_are_declared_for_wgrad_only(gen):
    x, w, _ = operands(gen, [4, 4], 8, 8, torch.bfloat16)
    reasons = gg.explain(x, list(w), [4, 4]).candidate(NAME).reasons
    assert [r.code for r in reasons] == ["layout"] and "stacked" in reasons[0].message


def test_non_contiguous_operands_are_copied_to_a_layout_torch_takes(gen):
    splits = [5, 0, 12, 9]
    m, n, k = sum(splits), 16, 24
    layouts = {
        "column-major x": torch.randn(k, m, generator=gen).bfloat16().t(),
        "row-strided x, aligned": torch.randn(m, 2 * k, generator=gen).bfloat16()[:, :k],
        "row-strided x, unaligned stride": torch.randn(m, k + 3, generator=gen).bfloat16()[:, :k],
    }
    w = torch.randn(4, k, n, generator=gen).bfloat16().transpose(1, 2)
    dy = torch.randn(n, m, generator=gen).bfloat16().t()
    for label, x in layouts.items():
        assert not x.is_contiguous(), label
        run_three_ops(x, w, dy, splits)


def test_device_offsets_path_matches_host_splits(gen):
    """run() with tensor splits (the device path: cumsum offsets, masked clearing) on CPU."""
    splits = [9, 0, 14, 0, 3]
    x, w, dy = operands(gen, splits, 16, 32, torch.bfloat16)
    backend = TorchGroupedMMBackend()
    for op, a, b in (("fwd", x, w), ("dgrad", dy, w), ("wgrad", dy, x)):
        problem = gg.describe_problem(op=op, groups=5, m=26, n=16, k=32, splits=splits, device_splits=True)
        on_host = backend.run(problem, gg.GroupedInputs(a, b, splits))
        on_device = backend.run(problem, gg.GroupedInputs(a, b, torch.tensor(splits)))
        assert torch.equal(on_host, on_device)


@pytest.mark.parametrize("device_splits", [False, True])
def test_empty_groups_cleared_where_torch_leaves_them_unwritten(device_splits):
    splits = [3, 0, 5, 0]
    dw = torch.full((4, 2, 3), float("nan"))
    _clear_empty_groups(dw, gg.GroupedInputs(None, None, torch.tensor(splits) if device_splits else splits))
    assert torch.count_nonzero(dw[1]) == 0 and torch.count_nonzero(dw[3]) == 0
    assert dw[0].isnan().all() and dw[2].isnan().all()


def test_sm100_clears_empty_wgrad_groups(gen):
    """sm_100 / ROCm leave empty groups unwritten (pytorch#172439, #174314): run() clears them."""
    splits = [4, 0, 8]
    x, _, dy = operands(gen, splits, 8, 8, torch.bfloat16)
    problem = gg.describe_problem(op="wgrad", groups=3, m=12, n=8, k=8, splits=splits, device="sm_100")
    dw = TorchGroupedMMBackend().run(problem, gg.GroupedInputs(dy, x, splits))
    assert torch.count_nonzero(dw[1]) == 0
    assert_accurate(dw, ref_wgrad(dy, x, splits))


# ---------------------------------------------------------------- declared eligibility


def reasons_for(**described) -> list[gg.Reason]:
    described = {"op": "fwd", "groups": 32, "m": 16384, "n": 2048, "k": 1024, **described}
    return list(gg.explain(**described).candidate(NAME).reasons)


def codes(**described) -> list[str]:
    return [r.code for r in reasons_for(**described)]


@pytest.mark.parametrize("arch", ["sm_90", "sm_100", "sm_103"])
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
def test_eligible_for_bf16_on_the_cutlass_archs(arch, op):
    assert codes(device=arch, op=op) == []
    assert codes(device=arch, op=op, device_splits=True) == []
    assert gg.explain(op=op, groups=32, m=16384, n=2048, k=1024, device=arch).selected == NAME


def test_other_cuda_archs_name_the_fallback():
    reasons = reasons_for(device="sm_80")
    assert [r.code for r in reasons] == ["arch"] and "sm_80" in reasons[0].message


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gpu_takes_bf16_only(dtype):
    reasons = reasons_for(device="sm_90", recipe=dtype.replace("float", "fp"))
    assert [r.code for r in reasons] == ["dtype"]
    assert "fallback loop" in reasons[0].message
    assert codes(device="cpu", recipe=dtype.replace("float", "fp")) == []


def test_result_dtype_must_be_the_input_dtype():
    reasons = reasons_for(device="sm_90", out_dtype="float32")
    assert [r.code for r in reasons] == ["dtype"] and "float32" in reasons[0].message
    assert codes(device="sm_90", op="wgrad", out_dtype="float32", accumulate=True) == ["dtype"]


@pytest.mark.parametrize(("n", "k", "dims"), [(2048, 1020, ["K"]), (100, 1024, ["N"]), (4, 6, ["N", "K"])])
def test_16_byte_strides(n, k, dims):
    reasons = reasons_for(device="sm_90", n=n, k=k)
    assert [r.code for r in reasons] == ["align"] * len(dims)
    assert [r.message.split("=")[0] for r in reasons] == dims
    assert "multiple of 8" in reasons[0].message
    assert codes(device="cpu", recipe="fp32", n=12, k=20) == []


def test_group_limit_of_the_cutlass_kernel():
    assert codes(device="sm_90", groups=1023, m=1023 * 16) == []
    reasons = reasons_for(device="sm_90", groups=1024, m=1024 * 16)
    assert [r.code for r in reasons] == ["groups"] and "1023" in reasons[0].message
    assert codes(device="cpu", groups=1024, m=1024 * 16) == []


def test_int32_offsets_bound_m():
    assert codes(device="sm_90", groups=2, m=2**31, n=16, k=16) == ["shape"]


def test_rocm_needs_the_ck_opt_in(monkeypatch):
    monkeypatch.delenv("ROCM_ALLOW_GROUP_GEMM_CK", raising=False)
    reasons = reasons_for(device="gfx942")
    assert [r.code for r in reasons] == ["config"] and "ROCM_ALLOW_GROUP_GEMM_CK" in reasons[0].message
    monkeypatch.setenv("ROCM_ALLOW_GROUP_GEMM_CK", "1")
    assert codes(device="gfx942") == []
    assert codes(device="gfx950") == []
    assert codes(device="gfx90a") == ["arch"]


def test_capture_needs_device_splits():
    host = gg.describe_problem(op="fwd", groups=8, m=4096, n=1024, k=1024, device="sm_90")
    device = gg.describe_problem(op="fwd", groups=8, m=4096, n=1024, k=1024, device="sm_90", device_splits=True)
    captured_host, _ = decide(dataclasses.replace(host, capturing=True))
    captured_device, _ = decide(dataclasses.replace(device, capturing=True))
    assert [r.code for r in captured_host.candidate(NAME).reasons] == ["capture"]
    assert captured_device.candidate(NAME).eligible and captured_device.selected == NAME


def test_mx_recipes_are_not_declared():
    assert "recipe" in codes(device="sm_90", recipe="mxfp8")


@pytest.mark.parametrize("op", ["fwd", "dgrad"])
def test_a16w4_only_for_its_plain_wgrad(op):
    assert codes(device="sm_90", recipe="a16w4", op=op) == ["recipe"]
    assert codes(device="sm_90", recipe="a16w4", op="wgrad") == []


def test_a16w4_wgrad_matches_float64(gen):
    """a16w4 keeps dy and x in bf16, so its wgrad is the plain bf16 product."""
    splits = SPLITS["empty-groups"]
    x, _, dy = operands(gen, splits, 24, 40, torch.bfloat16)
    with gg.use_backends(NAME, strict=True):
        dw = gg.grouped_gemm_wgrad(dy, x, splits, recipe="a16w4")
    assert_accurate(dw, ref_wgrad(dy, x, splits))


# ---------------------------------------------------------------- GPU: the CUTLASS kernel


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["balanced", "skewed"])
@pytest.mark.parametrize(("n", "k"), [(1024, 4096), (4096, 1024)])
def test_moe_sizes_on_gpu(gen, kind, n, k):
    splits = gg.balanced_splits(32, 16384) if kind == "balanced" else gg.skewed_splits(32, 16384)
    splits[3] = 0  # and one expert without tokens
    splits[0] += 16384 - sum(splits)
    x, w, dy = operands(gen, splits, n, k, torch.bfloat16, "cuda")
    run_three_ops(x, w, dy, splits)
    run_three_ops(x, w, dy, torch.tensor(splits, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("splits", EDGE_SPLITS, ids=["M0", "G1", "G256"])
def test_edge_splits_on_gpu(gen, splits):
    x, w, dy = operands(gen, splits, 64, 128, torch.bfloat16, "cuda")
    if sum(splits) == 0:
        with gg.use_backends(NAME, strict=True):
            assert gg.grouped_gemm(x, w, splits).shape == (0, 64)
            assert torch.count_nonzero(gg.grouped_gemm_wgrad(dy, x, torch.tensor(splits, device="cuda"))) == 0
        return
    run_three_ops(x, w, dy, splits)


@pytest.mark.gpu
def test_misaligned_and_strided_operands_on_gpu(gen):
    splits = [100, 0, 37, 211]
    m, n, k = sum(splits), 256, 512
    flat = torch.randn(m * k + 1, generator=gen).to("cuda", torch.bfloat16)
    x = flat[1:].view(m, k)  # base pointer 2 bytes past a 16-byte boundary
    assert x.data_ptr() % 16
    w = torch.randn(4, k, n, generator=gen).to("cuda", torch.bfloat16).transpose(1, 2)
    dy = torch.randn(m, 2 * n, generator=gen).to("cuda", torch.bfloat16)[:, :n]
    run_three_ops(x, w, dy, splits)


@pytest.mark.gpu
@pytest.mark.parametrize("shifted", ["x", "w", "dy"])
def test_contiguous_operands_with_a_misaligned_base_on_gpu(gen, shifted):
    """Both operands contiguous (the Problem says so): the fast row-major test still reads
    each base pointer, so a contiguous operand 2 bytes off a 16-byte boundary is copied."""
    splits = torch.tensor([100, 0, 37, 211], device="cuda")
    m, n, k = 348, 256, 512

    def operand(shape, name):
        numel = 1
        for d in shape:
            numel *= d
        flat = torch.randn(numel + 1, generator=gen).to("cuda", torch.bfloat16)
        return flat[1:].view(shape) if name == shifted else flat[:numel].view(shape)

    x, w, dy = operand((m, k), "x"), operand((4, n, k), "w"), operand((m, n), "dy")
    assert x.is_contiguous() and w.is_contiguous() and dy.is_contiguous()
    run_three_ops(x, w, dy, splits)


@pytest.mark.gpu
def test_wgrad_accumulate_on_gpu(gen):
    splits = [500, 0, 1200, 300]
    x, _, dy = operands(gen, splits, 512, 256, torch.bfloat16, "cuda")
    base = torch.randn(4, 512, 256, generator=gen).to("cuda", torch.bfloat16)
    out = base.clone()
    with gg.use_backends(NAME, strict=True):
        gg.grouped_gemm_wgrad(dy, x, torch.tensor(splits, device="cuda"), out=out, accumulate=True)
    assert_accumulated(out, base, ref_wgrad(dy, x, splits))
    assert torch.equal(out[1], base[1])


@pytest.mark.gpu
def test_group_limit_on_gpu(gen):
    splits = [8] * 1023
    x, w, _ = operands(gen, splits, 16, 16, torch.bfloat16, "cuda")
    with gg.use_backends(NAME, strict=True):
        assert_accurate(gg.grouped_gemm(x, w, splits), ref_fwd(x, w, splits))
    x, w, _ = operands(gen, [8] * 1024, 16, 16, torch.bfloat16, "cuda")
    assert [r.code for r in gg.explain(x, w, [8] * 1024).candidate(NAME).reasons] == ["groups"]


@pytest.mark.gpu
def test_cuda_graph_capture_with_device_splits(gen):
    """Capture fwd and wgrad once, replay with new splits written into the same tensor."""
    g, m, n, k = 8, 4096, 512, 1024
    splits = torch.tensor(gg.balanced_splits(g, m), device="cuda")
    x, w, dy = operands(gen, [m // g] * g, n, k, torch.bfloat16, "cuda")
    with gg.use_backends(NAME, strict=True):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            gg.grouped_gemm(x, w, splits)
            gg.grouped_gemm_wgrad(dy, x, splits)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gg.grouped_gemm(x, w, splits)
            dw = gg.grouped_gemm_wgrad(dy, x, splits)
            decision = gg.explain(x, w, [m // g] * g)
    assert [r.code for r in decision.candidate(NAME).reasons] == ["capture"]
    for new in (gg.skewed_splits(g, m), [0, 1000, 0, 0, 3000, 96, 0, 0]):
        splits.copy_(torch.tensor(new))
        poison(out)
        poison(dw)
        graph.replay()
        torch.cuda.synchronize()
        assert_accurate(out, ref_fwd(x, w, new))
        assert_accurate(dw, ref_wgrad(dy, x, new))
        assert all(torch.count_nonzero(dw[i]) == 0 for i, rows in enumerate(new) if rows == 0)


def _layouts() -> dict[str, tuple[torch.Tensor, bool]]:
    """Operands and whether torch takes them as they are (torch's stride rule)."""
    bf = torch.bfloat16
    base = torch.randn(4, 64, 48).to(bf)
    return {
        "contiguous 2-D": (base[0], True),
        "contiguous 3-D": (base, True),
        "fp32 contiguous, K=4": (torch.randn(5, 4), True),
        "rows of a wider buffer, aligned": (torch.randn(6, 64).to(bf)[:, :16], True),
        "unaligned base on the CPU": (torch.randn(6, 24).to(bf)[:, 8:], True),
        "column-major": (torch.randn(16, 8).to(bf).t(), False),
        "transposed 3-D": (base.transpose(1, 2), False),
        "3-D, odd group stride": (torch.randn(200).to(bf).as_strided((2, 4, 8), (36, 8, 1)), False),
        "rows overlapping": (torch.randn(64).to(bf).as_strided((4, 16), (8, 1)), False),
        # is_contiguous() ignores the stride of a size-1 dim; torch's stride rule does not.
        "one row, odd row stride": (torch.randn(64).to(bf).as_strided((1, 16), (21, 1)), False),
        "one group, odd group stride": (torch.randn(200).to(bf).as_strided((1, 4, 8), (37, 8, 1)), False),
    }


@pytest.mark.parametrize("label", list(_layouts()))
def test_row_major_keeps_what_torch_takes_and_copies_the_rest(label):
    t, kept = _layouts()[label]
    result = _row_major(t)
    assert (result is t) == kept, label
    assert torch.equal(result, t)
    if not kept:
        assert result.is_contiguous()


def test_a_one_row_view_with_an_odd_row_stride_runs(gen):
    """is_contiguous() ignores a size-1 dim's stride, torch's stride rule does not: such an
    x once reached torch unchanged and failed ("strides should be multiple of 16 bytes")."""
    x = torch.randn(64, generator=gen).to(torch.bfloat16).as_strided((1, 16), (21, 1))
    w = torch.randn(2, 24, 16, generator=gen).to(torch.bfloat16)
    y = gg.grouped_gemm(x, w, [0, 1], backend="torch_grouped_mm")
    assert_accurate(y, ref_fwd(x, w, [0, 1]))
