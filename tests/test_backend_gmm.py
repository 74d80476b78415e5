"""grouped_gemm.backend.gmm (the Megatron-style package's low-level entry) against float64.

Every output buffer is poisoned with NaN before the call; every layout runs on each CPU
backend (strict, so the named one really runs); GPU tests repeat the original package's
own edge cases at full size.
"""

from __future__ import annotations

import importlib
import re

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm import ops
from grouped_gemm.backends.reference import ReferenceBackend
from grouped_gemm.testing import poison, rel_error

SPLITS = {
    "fixed": [5, 5, 5, 5],
    "variable": [6, 0, 11, 3],
    "one_group": [13],
    "skewed": gg.skewed_splits(6, 50),
    "all_empty": [0, 0, 0],
}
#: The original package's zero-size edge case: 16384 rows over 8 experts, one empty, two tiny.
BIG_SIZES = [219, 2246, 5, 8103, 1, 1117, 4693, 0]
#: The same pattern at 1/16 scale for the CPU (the tiny and empty groups kept as they are).
SMALL_SIZES = [14, 140, 5, 506, 1, 70, 293, 0]
#: Backends that run on a CPU; padded_bmm is a plugin and may not be installed.
CPU_BACKENDS = ["reference", "torch_grouped_mm", "padded_bmm"]


def _registered(name: str) -> bool:
    return name in {b.name for b in gg.list_backends()}


@pytest.fixture(params=CPU_BACKENDS)
def only_backend(request):
    """Run the test with one backend only (strict: no silent fallback to another)."""
    if not _registered(request.param):
        pytest.skip(f"backend {request.param} is not installed")
    with gg.use_backends([request.param], strict=True):
        yield request.param


def ref_gmm(a: torch.Tensor, b: torch.Tensor, sizes: list[int], trans_b: bool) -> torch.Tensor:
    """Float64 (differentiable) ``a_g @ b_g`` (``b_g.T`` with trans_b), one matmul per group."""
    parts = torch.split(a.double(), sizes)
    return torch.cat([p @ (b[g].double().T if trans_b else b[g].double()) for g, p in enumerate(parts)])


def ref_gmm_trans_a(a: torch.Tensor, b: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Float64 ``a_g.T @ b_g`` per group -> (G, K_a, N_b); zeros for groups without rows."""
    pairs = zip(torch.split(a.double(), sizes), torch.split(b.double(), sizes), strict=True)
    return torch.stack([pa.T @ pb for pa, pb in pairs])


def _operands(sizes: list[int], k: int, n: int, trans_b: bool, dtype: torch.dtype, gen: torch.Generator):
    """Fresh random a (M, K) and b ((G, N, K) with trans_b, else (G, K, N)) on gen's device."""
    a = torch.randn(sum(sizes), k, generator=gen, device=gen.device).to(dtype)
    b = torch.randn((len(sizes), n, k) if trans_b else (len(sizes), k, n), generator=gen, device=gen.device)
    return a, b.to(dtype)


def test_reachable_as_the_original_names():
    module = importlib.import_module("grouped_gemm.backend")
    assert gg.backend is ops.backend is module
    assert ops.backend.gmm is module.gmm


@pytest.mark.parametrize("with_c", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("case", sorted(SPLITS))
def test_gmm_matches_float64(case, trans_b, with_c, only_backend, gen):
    sizes = SPLITS[case]
    a, b = _operands(sizes, 16, 24, trans_b, torch.float32, gen)
    c = poison(torch.empty(a.shape[0], 24)) if with_c else None
    out = gg.backend.gmm(a, b, torch.tensor(sizes), trans_b=trans_b, c=c)
    if with_c:
        assert out is c
    assert out.shape == (sum(sizes), 24) and out.dtype == torch.float32
    assert rel_error(out, ref_gmm(a, b, sizes, trans_b)) < 1e-6
    assert gg.dispatch_stats()["selected"] == {only_backend: 1}


@pytest.mark.parametrize("with_c", [False, True])
@pytest.mark.parametrize("case", sorted(SPLITS))
def test_trans_a_matches_float64_with_zero_empty_groups(case, with_c, only_backend, gen):
    sizes = SPLITS[case]
    a = torch.randn(sum(sizes), 16, generator=gen)
    b = torch.randn(sum(sizes), 24, generator=gen)
    c = poison(torch.empty(len(sizes), 16, 24)) if with_c else None
    out = gg.backend.gmm(a, b, torch.tensor(sizes), trans_a=True, c=c)
    if with_c:
        assert out is c
    expected = ref_gmm_trans_a(a, b, sizes)
    assert out.shape == (len(sizes), 16, 24)
    assert rel_error(out, expected) < 1e-6
    for g, rows in enumerate(sizes):
        if rows == 0:
            assert torch.equal(out[g], torch.zeros(16, 24)), f"group {g} has no rows: expected zeros"


@pytest.mark.parametrize("trans_b", [False, True])
def test_non_contiguous_operands(trans_b, only_backend, gen):
    """Views the original refuses (it needs contiguous a and b): a column slice of a wider a,
    b stored in the other layout and transposed."""
    sizes = SPLITS["variable"]
    _, stored = _operands(sizes, 24, 16, not trans_b, torch.float32, gen)
    a, b = torch.randn(sum(sizes), 40, generator=gen)[:, 8:32], stored.transpose(1, 2)
    assert not a.is_contiguous() and not b.is_contiguous()
    out = gg.backend.gmm(a, b, torch.tensor(sizes), trans_b=trans_b)
    assert rel_error(out, ref_gmm(a, b, sizes, trans_b)) < 1e-6


@pytest.mark.parametrize("batch_sizes_on", ["int64", "int32", "list"])
def test_bf16_and_batch_size_forms(batch_sizes_on, gen):
    sizes = SPLITS["variable"]
    forms = {
        "int64": torch.tensor(sizes),
        "int32": torch.tensor(sizes, dtype=torch.int32),
        "list": list(sizes),
    }
    a, b = _operands(sizes, 32, 16, True, torch.bfloat16, gen)
    out = gg.backend.gmm(a, b, forms[batch_sizes_on], trans_b=True)
    assert out.dtype == torch.bfloat16
    assert rel_error(out, ref_gmm(a, b, sizes, True)) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_zero_k_trans_a_into_poisoned_c(dtype, only_backend):
    """The original package's zero-K case (groups with no rows inside trans_a), scaled down.

    All-ones operands make every entry of group g exactly its row count (exact in bf16).
    """
    sizes = [0, 16, 0, 8]
    a = torch.ones(24, 16, dtype=dtype)
    b = torch.ones(24, 16, dtype=dtype)
    c = poison(torch.empty(4, 16, 16, dtype=dtype))
    assert gg.backend.gmm(a, b, torch.tensor(sizes), trans_a=True, c=c) is c
    for g, rows in enumerate(sizes):
        assert torch.equal(c[g], torch.full((16, 16), float(rows), dtype=dtype)), f"group {g}"


def _check_big_pattern(sizes: list[int], k: int, n: int, trans_b: bool, batch_sizes, gen, tol: float) -> None:
    """ops.gmm forward and both gradients vs float64 autograd of a per-group loop, then the
    same products through backend.gmm into poisoned buffers (bf16 on a GPU, fp32 on CPU)."""
    device = gen.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = _operands(sizes, k, n, trans_b, dtype, gen)
    grad = torch.randn(sum(sizes), n, generator=gen, device=device).to(dtype)
    al, bl = a.clone().requires_grad_(), b.clone().requires_grad_()
    out = ops.gmm(al, bl, batch_sizes, trans_b)
    out.backward(grad)
    a64, b64 = a.double().requires_grad_(), b.double().requires_grad_()
    out64 = ref_gmm(a64, b64, sizes, trans_b)
    out64.backward(grad.double())
    assert rel_error(out, out64) < tol
    assert rel_error(al.grad, a64.grad) < tol
    assert rel_error(bl.grad, b64.grad) < tol
    assert torch.equal(bl.grad[-1], torch.zeros_like(bl.grad[-1])), "the empty group's weight gradient is zero"

    c = poison(torch.empty(a.shape[0], n, dtype=dtype, device=device))
    gg.backend.gmm(a, b, batch_sizes, trans_b=trans_b, c=c)
    assert rel_error(c, out64) < tol
    # The weight gradient in the original's own form: trans_a=True over (a, grad) or (grad, a).
    lhs, rhs = (grad, a) if trans_b else (a, grad)
    db = poison(torch.empty(b.shape, dtype=dtype, device=device))
    gg.backend.gmm(lhs, rhs, batch_sizes, trans_a=True, c=db)
    assert rel_error(db, b64.grad) < tol
    assert torch.equal(db[-1], torch.zeros_like(db[-1]))


@pytest.mark.parametrize("trans_b", [False, True])
def test_zero_size_group_pattern_scaled_down(trans_b, gen):
    _check_big_pattern(SMALL_SIZES, 64, 96, trans_b, torch.tensor(SMALL_SIZES), gen, 1e-6)


@pytest.mark.parametrize("trans_b", [False, True])
def test_ops_gmm_backward_is_the_originals_backend_formula(trans_b, gen):
    """ops.gmm's gradients equal what the original's autograd Function computes with
    backend.gmm: da = gmm(grad, b, trans_b=not trans_b), db = gmm(., ., trans_a=True)."""
    sizes = SPLITS["variable"]
    a, b = _operands(sizes, 16, 24, trans_b, torch.float32, gen)
    grad = torch.randn(sum(sizes), 24, generator=gen)
    batch_sizes = torch.tensor(sizes)
    al, bl = a.clone().requires_grad_(), b.clone().requires_grad_()
    ops.gmm(al, bl, batch_sizes, trans_b).backward(grad)
    da = gg.backend.gmm(grad, b, batch_sizes, trans_b=not trans_b)
    lhs, rhs = (grad, a) if trans_b else (a, grad)
    db = gg.backend.gmm(lhs, rhs, batch_sizes, trans_a=True)
    assert rel_error(al.grad, da) < 1e-6
    assert rel_error(bl.grad, db) < 1e-6


def test_records_no_graph_and_writes_into_a_c_that_requires_grad(gen):
    """Like the original C++ entry: no autograd graph, and ``c`` may be a tensor that requires
    grad (MegaBlocks reuses an activation buffer as c in its backward)."""
    sizes = SPLITS["variable"]
    a, b = _operands(sizes, 16, 24, True, torch.float32, gen)
    a.requires_grad_()
    out = gg.backend.gmm(a, b, torch.tensor(sizes), trans_b=True)
    assert not out.requires_grad and out.grad_fn is None
    c = poison(torch.empty(a.shape[0], 24)).requires_grad_()
    buffer = c * 1.0  # a non-leaf that requires grad, like MegaBlocks' activation output
    gg.backend.gmm(a, b, torch.tensor(sizes), trans_b=True, c=buffer)
    assert rel_error(buffer, ref_gmm(a.detach(), b, sizes, True)) < 1e-6


class _Recorder(ReferenceBackend):
    spec = ReferenceBackend.spec.model_copy(update={"name": "spy_backend_gmm", "priority": 10_000})

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int, int | None]] = []

    def run(self, problem, inputs):
        out = inputs.out.data_ptr() if inputs.out is not None else None
        self.calls.append((problem.op, inputs.a.data_ptr(), inputs.b.data_ptr(), out))
        return super().run(problem, inputs)


@pytest.mark.parametrize("trans_a,trans_b,op", [(False, True, "fwd"), (False, False, "dgrad"), (True, False, "wgrad")])
def test_each_layout_is_one_dispatched_op_without_copies(trans_a, trans_b, op, gen, register):
    sizes = SPLITS["variable"]
    a = torch.randn(sum(sizes), 16, generator=gen)
    if trans_a:
        b, c = torch.randn(sum(sizes), 24, generator=gen), torch.empty(4, 16, 24)
    else:
        b = torch.randn((4, 24, 16) if trans_b else (4, 16, 24), generator=gen)
        c = torch.empty(sum(sizes), 24)
    spy = register(_Recorder())
    gg.backend.gmm(a, b, torch.tensor(sizes), trans_a=trans_a, trans_b=trans_b, c=c)
    assert spy.calls == [(op, a.data_ptr(), b.data_ptr(), c.data_ptr())]


def _bad_call(**change):
    """Arguments of a valid trans_b=False call (or trans_a=True with ``trans_a=True``), changed."""
    gen = torch.Generator().manual_seed(7)
    trans_a = change.get("trans_a") is True
    a = torch.randn(20, 12, generator=gen)
    b = torch.randn(20, 9, generator=gen) if trans_a else torch.randn(4, 12, 9, generator=gen)
    c = torch.empty(4, 12, 9) if trans_a else torch.empty(20, 9)
    args = {"a": a, "b": b, "batch_sizes": torch.tensor([6, 0, 11, 3]), "c": c, **change}
    for name, make in list(args.items()):
        if callable(make):
            args[name] = make(args["a"], args["b"])
    return args


@pytest.mark.parametrize(
    "change,error,argument,match",
    [
        ({"trans_a": 1}, gg.InvalidTypeError, "trans_a", "True or False"),
        ({"trans_b": "False"}, gg.InvalidTypeError, "trans_b", "True or False"),
        ({"trans_a": True, "trans_b": True}, gg.InvalidArgumentError, "trans_b", "trans_a=True"),
        ({"a": torch.zeros(2, 3, 4)}, gg.ShapeError, "a", "2-D"),
        ({"a": "a"}, gg.InvalidTypeError, "a", "torch.Tensor"),
        ({"a": torch.zeros(20, 12, dtype=torch.int64)}, gg.DTypeError, "a", "bfloat16"),
        ({"a": torch.zeros(20, 12).to_sparse()}, gg.InvalidTypeError, "a", "strided"),
        ({"b": torch.zeros(12, 9)}, gg.ShapeError, "b", "3-D"),
        ({"b": torch.zeros(4, 11, 9)}, gg.ShapeError, "b", "K=12"),
        (
            {"b": torch.zeros(0, 12, 9), "batch_sizes": torch.tensor([], dtype=torch.int64)},
            gg.ShapeError,
            "b",
            "G >= 1",
        ),
        ({"b": torch.zeros(4, 12, 9, dtype=torch.float16)}, gg.DTypeError, "b", "like a"),
        ({"b": torch.zeros(4, 12, 9, device="meta")}, gg.DeviceMismatchError, "b", "like a"),
        ({"trans_a": True, "b": torch.zeros(4, 20, 9)}, gg.ShapeError, "b", "2-D"),
        ({"trans_a": True, "b": torch.zeros(19, 9)}, gg.ShapeError, "b", "M=20"),
        ({"batch_sizes": torch.tensor([6, 0, 11])}, gg.SplitsError, "batch_sizes", "expected 4, got 3"),
        ({"batch_sizes": [6, 0, 11]}, gg.SplitsError, "batch_sizes", "expected 4, got 3"),
        ({"batch_sizes": torch.tensor([6, 0, 11, 4])}, gg.SplitsError, "batch_sizes", "sum to 21"),
        ({"batch_sizes": [6, 0, 11, 4]}, gg.SplitsError, "batch_sizes", "sum to 21"),
        ({"batch_sizes": torch.tensor([7, -1, 11, 3])}, gg.SplitsError, "batch_sizes", r"batch_sizes\[1\]=-1"),
        ({"batch_sizes": [7, -1, 11, 3]}, gg.SplitsError, "batch_sizes", r"batch_sizes\[1\]=-1"),
        ({"batch_sizes": [6, False, 11, 3]}, gg.SplitsError, "batch_sizes", "is a bool"),
        ({"batch_sizes": [6, 0.0, 11, 3]}, gg.SplitsError, "batch_sizes", "is a float"),
        ({"batch_sizes": torch.tensor([6.0, 0, 11, 3])}, gg.SplitsError, "batch_sizes", "int64"),
        ({"batch_sizes": torch.tensor([[6, 0, 11, 3]])}, gg.SplitsError, "batch_sizes", "1-D"),
        ({"batch_sizes": "6,0,11,3"}, gg.InvalidTypeError, "batch_sizes", "int64"),
        ({"batch_sizes": torch.tensor([6, 0, 11, 3], device="meta")}, gg.DeviceMismatchError, "batch_sizes", "CPU"),
        # int64 wrap-around would make these sum to 20; Python ints do not wrap.
        ({"batch_sizes": torch.tensor([2**63 - 1, 2**63 - 1, 11, 11])}, gg.SplitsError, "batch_sizes", "a.shape"),
        ({"trans_a": True, "batch_sizes": torch.tensor([], dtype=torch.int64)}, gg.SplitsError, "batch_sizes", "one"),
        ({"c": torch.empty(20, 8)}, gg.ShapeError, "c", r"\(20, 9\)"),
        ({"c": torch.empty(4, 12, 9)}, gg.ShapeError, "c", "2-D"),
        ({"trans_a": True, "c": torch.empty(4, 9, 12)}, gg.ShapeError, "c", r"\(4, 12, 9\)"),
        ({"c": torch.empty(20, 9, dtype=torch.bfloat16)}, gg.DTypeError, "c", "like a"),
        ({"c": torch.empty(9, 20).T}, gg.InvalidArgumentError, "c", "contiguous"),
        ({"c": [0.0] * 9}, gg.InvalidTypeError, "c", "torch.Tensor"),
        (
            {"a": torch.zeros(20, 9), "b": torch.zeros(4, 9, 9), "c": lambda a, b: a},
            gg.InvalidArgumentError,
            "c",
            "overlap a",
        ),
    ],
)
def test_bad_arguments_are_named(change, error, argument, match):
    with pytest.raises(error, match=f"^{argument}=") as info:
        gg.backend.gmm(**_bad_call(**change))
    assert info.value.argument == argument
    assert re.search(match, str(info.value)), str(info.value)


def test_c_overlapping_b_is_refused():
    a = torch.randn(8, 4)
    storage = torch.randn(2 * 4 * 8 + 8 * 8)
    b = storage[: 2 * 4 * 8].view(2, 4, 8)
    c = storage[2 * 4 * 8 - 8 :][: 8 * 8].view(8, 8)  # starts inside b's last row
    with pytest.raises(gg.InvalidArgumentError, match=r"^c=.*overlap b"):
        gg.backend.gmm(a, b, torch.tensor([3, 5]), c=c)
    beside = storage[2 * 4 * 8 :].view(8, 8)  # the same storage, right after b: allowed
    gg.backend.gmm(a, b, torch.tensor([3, 5]), c=beside)
    assert rel_error(beside, ref_gmm(a, b, [3, 5], False)) < 1e-6


@pytest.mark.parametrize(
    "batch_sizes,match",
    [
        ([6, 0, 11], "expected 4, got 3"),
        ([6, 0, 11, 4], "sum to 21"),
        ([7, -1, 11, 3], r"batch_sizes\[1\]=-1"),
        ([6, True, 11, 3], "is a bool"),
        ((6, 0, 11, 3.0), "is a float"),
    ],
)
def test_ops_gmm_list_batch_sizes_errors_name_batch_sizes(batch_sizes, match, gen):
    """Issue 12: a list ``batch_sizes`` used to be reported as ``m_splits``."""
    a, b = _operands([6, 0, 11, 3], 12, 9, False, torch.float32, gen)
    with pytest.raises(gg.SplitsError, match=f"^batch_sizes=.*{match}") as info:
        ops.gmm(a, b, batch_sizes)
    assert "m_splits" not in str(info.value)


@pytest.mark.parametrize(
    "module,name",
    [("ops", "permute"), ("ops", "unpermute"), ("ops", "PermuteMoE_topK"), ("backend", "sinkhorn")],
)
def test_names_of_the_nvidia_fork_say_they_are_not_provided(module, name):
    target = getattr(gg, module)
    assert not hasattr(target, name)
    with pytest.raises(AttributeError, match="grouped GEMMs only"):
        getattr(target, name)
    with pytest.raises(ImportError):
        exec(f"from grouped_gemm.{module} import {name}", {})
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        target.nothing_here  # noqa: B018


# --- GPU: the original package's tests at their sizes, host and device batch sizes ---------


def _on(sizes: list[int], where: str) -> torch.Tensor:
    return torch.tensor(sizes).to("cuda" if where == "device" else "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("batch_sizes_on", ["host", "device"])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("sizes", [[512] * 8, [219, 1400, 5, 0, 2048, 1, 333, 90]], ids=["fixed", "variable"])
def test_gpu_gmm_layouts(sizes, trans_b, batch_sizes_on):
    gen = torch.Generator(device="cuda").manual_seed(11)
    a, b = _operands(sizes, 512, 768, trans_b, torch.bfloat16, gen)
    batch_sizes = _on(sizes, batch_sizes_on)
    c = poison(torch.empty(a.shape[0], 768, dtype=torch.bfloat16, device="cuda"))
    assert gg.backend.gmm(a, b, batch_sizes, trans_b=trans_b, c=c) is c
    assert rel_error(c, ref_gmm(a, b, sizes, trans_b)) < 1e-2
    assert rel_error(gg.backend.gmm(a, b, batch_sizes, trans_b=trans_b), ref_gmm(a, b, sizes, trans_b)) < 1e-2
    rhs = torch.randn(a.shape[0], 256, generator=gen, device="cuda").to(torch.bfloat16)
    dw = poison(torch.empty(len(sizes), 512, 256, dtype=torch.bfloat16, device="cuda"))
    gg.backend.gmm(a, rhs, batch_sizes, trans_a=True, c=dw)
    assert rel_error(dw, ref_gmm_trans_a(a, rhs, sizes)) < 1e-2
    for g, rows in enumerate(sizes):
        if rows == 0:
            assert torch.equal(dw[g], torch.zeros_like(dw[g]))
    print(f"\nGPU backend.gmm backends ({batch_sizes_on} batch_sizes):", gg.dispatch_stats()["selected"])


@pytest.mark.gpu
@pytest.mark.parametrize("batch_sizes_on", ["host", "device"])
def test_gpu_zero_k_trans_a(batch_sizes_on):
    """The original package's zero-K test at its size, with c poisoned instead of ones."""
    sizes = [0, 128, 0, 64]
    a = torch.ones(192, 128, dtype=torch.bfloat16, device="cuda")
    b = torch.ones(192, 128, dtype=torch.bfloat16, device="cuda")
    c = poison(torch.empty(4, 128, 128, dtype=torch.bfloat16, device="cuda"))
    gg.backend.gmm(a, b, _on(sizes, batch_sizes_on), trans_a=True, c=c)
    for g, rows in enumerate(sizes):
        assert torch.equal(c[g], torch.full_like(c[g], rows)), f"group {g}"


@pytest.mark.gpu
@pytest.mark.parametrize("batch_sizes_on", ["host", "device"])
@pytest.mark.parametrize("trans_b", [False, True])
def test_gpu_zero_size_group_in_a_large_problem(trans_b, batch_sizes_on):
    """16384 x 4096 x 14336 in bf16 with sizes [219, 2246, 5, 8103, 1, 1117, 4693, 0]."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    _check_big_pattern(BIG_SIZES, 4096, 14336, trans_b, _on(BIG_SIZES, batch_sizes_on), gen, 1e-2)
    print(f"\nGPU 16384x4096x14336 backends ({batch_sizes_on} batch_sizes):", gg.dispatch_stats()["selected"])
