"""triton_grouped: every op against a float64 reference, eligibility and priority.

On the CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
when no GPU is visible) on tiny shapes; outputs are poisoned with NaN first, so a row or
group a kernel forgets shows up. The GPU tests at the end compare with torch._grouped_mm
and capture the fp32-accumulating wgrad in a CUDA graph (``pytest -m gpu``).
"""

from __future__ import annotations

import threading

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm.backends.triton_mx import TritonGroupedBackend, grouped, launch
from grouped_gemm.testing import output_floor_db, poison, ref_dgrad, ref_fwd, ref_wgrad, rel_error, sqnr_db

NAME = "triton_grouped"
#: fp32 results of bf16 / fp16 products summed in fp32: only the summation order differs.
FP32_OUT_TOL = 1e-5
#: A 16-bit result: one rounding of each output (bf16 has 8 significant bits).
HALF_OUT_TOL = {torch.bfloat16: 8e-3, torch.float16: 1e-3}
SPLITS = {
    "unaligned_with_empty": [5, 0, 40, 3],
    "single_group": [37],
    "skewed": [1, 0, 0, 70, 2, 0],
    "all_empty": [0, 0, 0],
}

needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or not launch.interpreted(), reason="CPU tests run the kernels in Triton's interpreter"
)


def _operands(op, splits, n, k, dtype, gen, device="cpu"):
    """(a, b) of an op: random normal data rounded to ``dtype``."""
    m, groups = sum(splits), len(splits)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    if op == "fwd":
        return rand(m, k), rand(groups, n, k)
    if op == "dgrad":
        return rand(m, n), rand(groups, n, k)
    return rand(m, n), rand(m, k)


def _reference(op, a, b, splits):
    return {"fwd": ref_fwd, "dgrad": ref_dgrad, "wgrad": ref_wgrad}[op](a, b, splits)


def _call(op, a, b, splits, backend=NAME, **kwargs):
    with gg.use_backends(backend, strict=True):
        if op == "fwd":
            return gg.grouped_gemm(a, b, splits, **kwargs)
        if op == "dgrad":
            return gg.grouped_gemm_dgrad(a, b, splits, **kwargs)
        return gg.grouped_gemm_wgrad(a, b, splits, **kwargs)


def _out_shape(op, splits, n, k):
    m = sum(splits)
    return {"fwd": (m, n), "dgrad": (m, k), "wgrad": (len(splits), n, k)}[op]


@needs_interpreter
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize("splits", list(SPLITS.values()), ids=list(SPLITS))
@pytest.mark.parametrize("device_splits", [False, True], ids=["host_splits", "device_splits"])
def test_fp32_results_match_float64(op, splits, device_splits, gen):
    """Every row (and every wgrad group, zeros for empty ones) written into a NaN-poisoned
    fp32 ``out``; unaligned group sizes, G=1, skewed and empty groups, both split kinds."""
    n, k = 48, 40
    a, b = _operands(op, splits, n, k, torch.bfloat16, gen)
    out = poison(torch.empty(_out_shape(op, splits, n, k)))
    sizes = torch.tensor(splits) if device_splits else splits
    got = _call(op, a, b, sizes, out=out, out_dtype=torch.float32)
    assert got is out
    want = _reference(op, a, b, splits)
    assert torch.isfinite(got).all(), "unwritten (NaN-poisoned) outputs"
    assert rel_error(got, want) < FP32_OUT_TOL
    if op == "wgrad":
        empty = [g for g, rows in enumerate(splits) if rows == 0]
        assert torch.equal(got[empty], torch.zeros_like(got[empty]))


@needs_interpreter
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_results(op, dtype, gen):
    """A new result in the operands' dtype (bf16 and fp16), rounded once from fp32."""
    splits = [9, 0, 33, 17]
    a, b = _operands(op, splits, 32, 64, dtype, gen)
    got = _call(op, a, b, splits)
    assert got.dtype == dtype
    assert rel_error(got, _reference(op, a, b, splits)) < HALF_OUT_TOL[dtype]


@needs_interpreter
@pytest.mark.parametrize("device_splits", [False, True], ids=["host_splits", "device_splits"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_wgrad_accumulates_into_fp32_main_grad(device_splits, dtype, gen):
    """Megatron's main_grad: ``out += dy_g^T @ x_g`` in fp32 in one launch; groups without
    rows leave their (random) slices bit for bit untouched."""
    splits = [6, 0, 45, 0, 13]
    n, k = 40, 56
    dy, x = _operands("wgrad", splits, n, k, dtype, gen)
    main_grad = torch.randn(len(splits), n, k, generator=gen)
    before = main_grad.clone()
    sizes = torch.tensor(splits) if device_splits else splits
    got = _call("wgrad", dy, x, sizes, out=main_grad, out_dtype=torch.float32, accumulate=True)
    assert got is main_grad
    want = before.double() + ref_wgrad(dy, x, splits)
    assert rel_error(got, want) < FP32_OUT_TOL
    assert torch.equal(got[[1, 3]], before[[1, 3]])


@needs_interpreter
def test_wgrad_without_rows(gen):
    """M = 0: accumulating leaves out untouched, otherwise it is all zeros."""
    dy, x = torch.zeros(0, 16, dtype=torch.bfloat16), torch.zeros(0, 24, dtype=torch.bfloat16)
    main_grad = torch.randn(3, 16, 24, generator=gen)
    before = main_grad.clone()
    _call("wgrad", dy, x, [0, 0, 0], out=main_grad, out_dtype=torch.float32, accumulate=True)
    assert torch.equal(main_grad, before)
    _call("wgrad", dy, x, [0, 0, 0], out=poison(main_grad), out_dtype=torch.float32)
    assert torch.equal(main_grad, torch.zeros_like(main_grad))


@needs_interpreter
@pytest.mark.parametrize("op", ["fwd", "dgrad"])
@pytest.mark.parametrize(("n", "k"), [(0, 16), (16, 0)], ids=["n0", "k0"])
def test_empty_n_or_k(op, n, k, gen):
    """N or K = 0 (0 is a multiple of the declared alignment, so the backend is eligible):
    an empty weight takes pointer loads, since a tensor descriptor's sizes must be
    positive; an empty contraction writes zeros over a NaN-poisoned out."""
    splits = [2, 4]
    a, b = _operands(op, splits, n, k, torch.bfloat16, gen)
    out = poison(torch.empty(_out_shape(op, splits, n, k), dtype=torch.bfloat16))
    got = _call(op, a, b, splits, out=out)
    assert got is out
    assert torch.equal(got.double(), _reference(op, a, b, splits))


@needs_interpreter
def test_threads_interpreting_at_once():
    """Triton's interpreter patches triton.language while a kernel runs: two threads
    launching at once broke each other ('Did you forget to add @triton.jit ?') until
    interpreted launches took turns."""
    results: list[float] = []
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for _ in range(3):
            a, b = _operands("fwd", [2, 4], 8, 16, torch.bfloat16, gen)
            try:
                results.append(rel_error(_call("fwd", a, b, [2, 4]), _reference("fwd", a, b, [2, 4])))
            except Exception as exc:  # noqa: BLE001 - every error is a finding
                errors.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]
    assert len(results) == 12 and max(results) < HALF_OUT_TOL[torch.bfloat16]


@needs_interpreter
@pytest.mark.parametrize("transpose_w", [True, False], ids=["fwd", "dgrad"])
def test_kernel_masks_unaligned_n_and_k(transpose_w, gen):
    """The backend declares 16-byte rows for fast loads, but the kernel itself is correct for
    any N and K (masked loads and stores): the launch on N=13, K=21."""
    splits = [3, 0, 20]
    n, k = 13, 21
    w = torch.randn(3, n, k, generator=gen).bfloat16()
    a = torch.randn(23, k if transpose_w else n, generator=gen).bfloat16()
    out = poison(torch.empty(23, n if transpose_w else k))
    launch.launch_grouped(a, w, torch.tensor(splits, dtype=torch.int32), out, transpose_w=transpose_w)
    want = ref_fwd(a, w, splits) if transpose_w else ref_dgrad(a, w, splits)
    assert rel_error(out, want) < FP32_OUT_TOL


@needs_interpreter
@pytest.mark.parametrize("transpose_w", [True, False], ids=["fwd", "dgrad"])
@pytest.mark.parametrize("tma", [1, 0], ids=["tma", "pointer_loads"])
def test_tma_and_pointer_loads_match_float64(transpose_w, tma, gen):
    """Both load paths of the fwd / dgrad kernel at one tile config: row tiles that run past
    their group into the next (and past M), a contraction tail (K=40 with 32-wide steps), a
    column tail (N=48 with 32-wide tiles), empty groups, into NaN-poisoned output."""
    splits = [5, 0, 41, 0, 2]
    n, k = 48, 40
    w = torch.randn(len(splits), n, k, generator=gen).bfloat16()
    a = torch.randn(sum(splits), k if transpose_w else n, generator=gen).bfloat16()
    assert launch.tma_runs(a, w)
    out = poison(torch.empty(sum(splits), n if transpose_w else k))
    config = launch.GroupedConfig(bm=16, bn=32, bk=32, warps=4, stages=1, per_sm=1, tma=tma)
    launch.launch_grouped(a, w, torch.tensor(splits, dtype=torch.int32), out, transpose_w=transpose_w, config=config)
    want = ref_fwd(a, w, splits) if transpose_w else ref_dgrad(a, w, splits)
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) outputs"
    assert rel_error(out, want) < FP32_OUT_TOL


@needs_interpreter
def test_tma_config_on_unaligned_operand_takes_pointer_loads(gen):
    """An activation whose base is not 16-byte aligned (a view one element into its storage)
    cannot be described to TMA: the launch reads it through pointers instead, rightly."""
    splits = [3, 4]
    w = torch.randn(2, 16, 8, generator=gen).bfloat16()
    a = torch.randn(57, generator=gen).bfloat16()[1:].view(7, 8)
    assert a.data_ptr() % 16 and not launch.tma_runs(a, w)
    out = poison(torch.empty(7, 16))
    config = launch.GroupedConfig(bm=16, bn=16, bk=16, warps=4, stages=1, per_sm=1, tma=1)
    launch.launch_grouped(a, w, torch.tensor(splits, dtype=torch.int32), out, transpose_w=True, config=config)
    assert rel_error(out, ref_fwd(a, w, splits)) < FP32_OUT_TOL


def _reasons(**described):
    """Every reason triton_grouped gives for a described problem (declared and its own), as one string."""
    described = {"groups": 4, "m": 256, "n": 64, "k": 64, "recipe": "bf16", **described}
    return str(gg.explain(**described).candidate(NAME).reasons)


@pytest.mark.parametrize(
    ("described", "reason"),
    [
        ({"recipe": "fp32"}, "recipe fp32 not supported"),
        ({"recipe": "mxfp8"}, "recipe mxfp8 not supported"),
        ({"n": 60}, "N=60 is not a multiple of 8"),
        ({"k": 36}, "K=36 is not a multiple of 8"),
        ({"groups": 1025, "m": 2048}, "G=1025 exceeds the maximum 1024"),
        ({"recipe": "fp16", "out_dtype": "bfloat16"}, "out dtype bfloat16 from float16"),
        # Less shared memory than the 4-stage tiles need.
        ({"device": "sm_89"}, "arch sm_89 not supported"),
        ({"device": "gfx942"}, "device vendor rocm not supported"),
    ],
)
def test_refuses_with_a_reason(described, reason):
    assert reason in _reasons(**{"device": "cpu", **described})


def test_declares_no_fp32_operands():
    """tl.dot on fp32 tiles multiplies in tf32, which is not an fp32 GEMM."""
    assert TritonGroupedBackend.spec.dtypes == frozenset({"bfloat16", "float16"})
    assert "fp32" not in TritonGroupedBackend.spec.recipes


@needs_interpreter
def test_interpreter_refuses_gpu_placement():
    reasons = _reasons(device="sm_90")
    assert "TRITON_INTERPRET=1 is set" in reasons


@pytest.fixture
def compiled(monkeypatch):
    """Judge described GPU problems as a compiled (not interpreted) Triton would."""
    monkeypatch.setattr(launch, "interpreted", lambda: False)


@pytest.mark.parametrize(
    ("described", "selected"),
    [
        # torch_grouped_mm stays the default where it runs (bf16 -> bf16), until measured.
        ({"op": "fwd"}, "torch_grouped_mm"),
        ({"op": "wgrad", "accumulate": True, "device_splits": True}, "torch_grouped_mm"),
        # What it refuses comes here rather than to multistream's per-group loop (which
        # would read device splits back).
        ({"op": "wgrad", "out_dtype": "float32", "accumulate": True, "device_splits": True}, NAME),
        ({"op": "fwd", "recipe": "fp16"}, NAME),
        ({"op": "dgrad", "out_dtype": "float32"}, NAME),
    ],
)
def test_gpu_priority_between_torch_grouped_mm_and_multistream(compiled, described, selected):
    decision = gg.explain(groups=8, m=4096, n=512, k=256, device="sm_90", **described)
    assert decision.selected == selected
    names = [c.name for c in decision.candidates]
    assert names.index("torch_grouped_mm") < names.index(NAME) < names.index("multistream")


@pytest.mark.parametrize(("groups", "selected"), [(8, "multistream"), (64, "multistream"), (128, NAME)])
def test_gpu_host_split_wgrad_of_few_groups_goes_to_multistream(compiled, groups, selected):
    """Measured on the H200: fp32-accumulating wgrad of G=32 large groups ran faster as
    per-group vendor GEMMs; of 128 groups, here."""
    decision = gg.explain(
        op="wgrad", groups=groups, m=64 * groups, n=512, k=256, device="sm_90", out_dtype="float32", accumulate=True
    )
    assert decision.selected == selected


@pytest.mark.parametrize(
    ("shape", "selected"),
    [
        ({"groups": 128, "m": 256, "n": 5760, "k": 2880}, NAME),  # gptoss120b gate-up decode
        ({"groups": 32, "m": 512, "n": 4096, "k": 7168, "op": "dgrad"}, NAME),  # dsv3 gate-up decode
        ({"groups": 128, "m": 512, "n": 1536, "k": 2048}, NAME),  # qwen3_30b gate-up decode: 3.1 M weights
        ({"groups": 128, "m": 512, "n": 1024, "k": 2048}, NAME),  # 2 M: at the floor
        ({"groups": 128, "m": 512, "n": 1024, "k": 2040}, "torch_grouped_mm"),  # just under: small experts
        ({"groups": 128, "m": 65536, "n": 5760, "k": 2880}, "torch_grouped_mm"),  # training rows
        ({"groups": 128, "m": 256, "n": 5760, "k": 2880, "op": "wgrad"}, "torch_grouped_mm"),
    ],
)
def test_gpu_decode_with_large_experts_comes_here(compiled, shape, selected):
    """Measured on the H200: 1.38-1.53x torch._grouped_mm when a few rows per expert stream
    expert weights of 3.1 M elements or more; not below the floor (unmeasured), nor for
    training-sized groups."""
    assert gg.explain(device="sm_90", device_splits=True, **shape).selected == selected


@pytest.mark.parametrize(
    ("shape", "selected"),
    [
        ({"groups": 128, "m": 16384, "n": 5760, "k": 2880}, NAME),  # gptoss120b gate-up: 128 rows per group
        ({"groups": 32, "m": 2048, "n": 7168, "k": 2048, "op": "dgrad"}, NAME),  # 64 rows per group
        ({"groups": 32, "m": 1025, "n": 7168, "k": 2048}, NAME),  # M's bucket (2048) is 64 rows a group
        ({"groups": 32, "m": 1024, "n": 7168, "k": 2048}, "torch_grouped_mm"),  # 32 rows a group
        ({"groups": 128, "m": 16385, "n": 2048, "k": 768}, "torch_grouped_mm"),  # just over 128
        ({"groups": 128, "m": 16384, "n": 2880, "k": 2880, "op": "wgrad"}, "torch_grouped_mm"),
    ],
)
def test_gpu_fwd_and_dgrad_of_64_to_128_rows_per_group_come_here(compiled, shape, selected):
    """Measured on the H200: 1.01-1.63x torch._grouped_mm at 64 and 128 rows per group on
    six expert shapes, balanced and skewed; not at 256 rows on balanced splits. Rows per
    group are read from M's bucket (one decision serves it)."""
    assert gg.explain(device="sm_90", device_splits=True, **shape).selected == selected


def test_cpu_priority_below_reference():
    """On the CPU the interpreter is for tests: torch's loop and the reference rank above."""
    decision = gg.explain(groups=4, m=64, n=32, k=32, recipe="bf16", device="cpu")
    names = [c.name for c in decision.candidates]
    assert names.index("reference") < names.index(NAME)
    assert grouped.PRIORITY == 30 and grouped.CPU_PRIORITY < 0


# --- GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize("m", [80, 400, 3000], ids=["bm16", "bm64", "bm128"])
@pytest.mark.parametrize("splits", ["balanced", "skewed_with_empty"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_matches_float64_and_torch_grouped_mm(op, m, splits, dtype, gen):
    """Every tile configuration (by mean rows per group): an fp32 result against float64 at
    the same-function floor (60 dB); a bf16 result against torch._grouped_mm's at the bf16
    output floor (both round the same fp32 sums once)."""
    device = torch.device("cuda")
    g, n, k = 8, 1024, 512
    sizes = gg.balanced_splits(g, m) if splits == "balanced" else gg.skewed_splits(g, m)
    if splits != "balanced":
        sizes = [0, *sizes[1:-1], sizes[0] + sizes[-1]]
    a, b = _operands(op, sizes, n, k, dtype, gen, device)
    device_sizes = torch.tensor(sizes, device=device)
    got = _call(op, a, b, device_sizes, out_dtype=torch.float32)
    assert sqnr_db(got, _reference(op, a, b, sizes)) >= output_floor_db("float32")
    if dtype == torch.bfloat16:
        got = _call(op, a, b, device_sizes)
        want = _call(op, a, b, sizes, backend="torch_grouped_mm")
        assert sqnr_db(got, want) >= output_floor_db("bfloat16")


@pytest.mark.gpu
def test_gpu_cuda_graph_accumulating_wgrad(gen):
    """Device splits, fp32 main_grad accumulation: one capturable launch."""
    device = torch.device("cuda")
    splits = torch.tensor([300, 0, 1200, 37, 0, 463], device=device)
    n, k = 512, 1024
    dy, x = _operands("wgrad", splits.tolist(), n, k, torch.bfloat16, gen, device)
    main_grad = torch.zeros(6, n, k, device=device)
    _call("wgrad", dy, x, splits, out=main_grad, accumulate=True)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _call("wgrad", dy, x, splits, out=main_grad, accumulate=True)
    main_grad.fill_(1.0)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    want = 1.0 + 2 * ref_wgrad(dy, x, splits.tolist())
    assert rel_error(main_grad, want) < FP32_OUT_TOL
    assert torch.equal(main_grad[[1, 4]], torch.ones_like(main_grad[[1, 4]]))
