"""ops.gmm, the drop-in for the Megatron-style grouped_gemm package, against float64."""

from __future__ import annotations

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm import ops
from grouped_gemm.backends.reference import ReferenceBackend
from grouped_gemm.testing import rel_error

SPLITS = {
    "mixed": [6, 0, 11, 3],
    "all_empty": [0, 0, 0, 0],
    "one_group": [13],
    "skewed": gg.skewed_splits(6, 50),
    "unaligned": [1, 7, 2],
}


def ref_gmm(a: torch.Tensor, b: torch.Tensor, splits: list[int], trans_b: bool) -> torch.Tensor:
    """Float64, differentiable: rows of group g times b[g] (or b[g].T)."""
    parts = torch.split(a, splits)
    outs = [p @ (b[g].T if trans_b else b[g]) for g, p in enumerate(parts)]
    return torch.cat(outs)


def _problem(splits: list[int], k: int, n: int, trans_b: bool, dtype: torch.dtype, gen: torch.Generator):
    a = torch.randn(sum(splits), k, generator=gen).to(dtype)
    shape = (len(splits), n, k) if trans_b else (len(splits), k, n)
    b = torch.randn(shape, generator=gen).to(dtype)
    grad = torch.randn(sum(splits), n, generator=gen).to(dtype)
    return a, b, grad


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("case", sorted(SPLITS))
def test_gmm_and_grads_match_float64(trans_b, case, gen):
    splits = SPLITS[case]
    a, b, grad = _problem(splits, 12, 9, trans_b, torch.float32, gen)
    al, bl = a.clone().requires_grad_(), b.clone().requires_grad_()
    out = ops.gmm(al, bl, torch.tensor(splits), trans_b=trans_b)
    out.backward(grad)
    a64, b64 = a.double().requires_grad_(), b.double().requires_grad_()
    out64 = ref_gmm(a64, b64, splits, trans_b)
    out64.backward(grad.double())
    assert out.shape == (sum(splits), 9) and out.dtype == torch.float32
    assert rel_error(out, out64) < 1e-5
    assert rel_error(al.grad, a64.grad) < 1e-5
    assert bl.grad.shape == b.shape
    assert rel_error(bl.grad, b64.grad) < 1e-5


@pytest.mark.parametrize("trans_b", [False, True])
def test_gmm_bf16(trans_b, gen):
    splits = SPLITS["skewed"]
    a, b, grad = _problem(splits, 32, 16, trans_b, torch.bfloat16, gen)
    al, bl = a.clone().requires_grad_(), b.clone().requires_grad_()
    out = ops.gmm(al, bl, torch.tensor(splits), trans_b)
    out.backward(grad)
    a64, b64 = a.double().requires_grad_(), b.double().requires_grad_()
    ref_gmm(a64, b64, splits, trans_b).backward(grad.double())
    assert out.dtype == al.grad.dtype == bl.grad.dtype == torch.bfloat16
    assert rel_error(out, ref_gmm(a.double(), b.double(), splits, trans_b)) < 1e-2
    assert rel_error(al.grad, a64.grad) < 1e-2
    assert rel_error(bl.grad, b64.grad) < 1e-2


@pytest.mark.parametrize("batch_sizes", [[6, 0, 11, 3], torch.tensor([6, 0, 11, 3], dtype=torch.int32)])
def test_batch_sizes_as_list_or_int32(batch_sizes, gen):
    a, b, _ = _problem([6, 0, 11, 3], 12, 9, False, torch.float32, gen)
    assert rel_error(ops.gmm(a, b, batch_sizes), ref_gmm(a.double(), b.double(), [6, 0, 11, 3], False)) < 1e-5


class _Recorder(ReferenceBackend):
    spec = ReferenceBackend.spec.model_copy(update={"name": "spy_gmm", "priority": 10_000})

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def run(self, problem, inputs):
        self.calls.append((problem.op, inputs.b.data_ptr(), inputs.a.data_ptr()))
        return super().run(problem, inputs)


@pytest.mark.parametrize("trans_b,ops_run", [(False, ["dgrad", "fwd", "wgrad"]), (True, ["fwd", "dgrad", "wgrad"])])
def test_b_is_used_in_place_without_copies(trans_b, ops_run, gen, register):
    """Both layouts map onto an op that reads b as it is (no transpose copy per call)."""
    spy = register(_Recorder())
    a, b, grad = _problem([6, 0, 11, 3], 12, 9, trans_b, torch.bfloat16, gen)
    b.requires_grad_()
    ops.gmm(a.requires_grad_(), b, torch.tensor([6, 0, 11, 3]), trans_b).backward(grad)
    assert [c[0] for c in spy.calls] == ops_run
    assert spy.calls[0][1] == b.data_ptr()
    assert spy.calls[1][1] == b.data_ptr()


@pytest.mark.parametrize(
    "change,error,match",
    [
        ({"a": torch.zeros(2, 3, 4)}, gg.ShapeError, "a="),
        ({"b": torch.zeros(12, 9)}, gg.ShapeError, "b="),
        ({"b": torch.zeros(4, 11, 9)}, gg.ShapeError, "K=12"),
        ({"b": torch.zeros(4, 12, 9, dtype=torch.float16)}, gg.DTypeError, "b="),
        ({"batch_sizes": torch.tensor([6, 0, 11])}, gg.SplitsError, "batch_sizes"),
        ({"batch_sizes": torch.tensor([6, 0, 11, 4])}, gg.SplitsError, "summing to a.shape"),
        ({"batch_sizes": torch.tensor([7, -1, 11, 3])}, gg.SplitsError, "non-negative"),
        ({"batch_sizes": torch.tensor([6.0, 0, 11, 3])}, gg.SplitsError, "int64"),
        ({"batch_sizes": "6,0,11,3"}, gg.InvalidTypeError, "batch_sizes"),
        ({"trans_b": 1}, gg.InvalidTypeError, "trans_b"),
    ],
)
def test_bad_arguments_are_named(change, error, match, gen):
    a, b, _ = _problem([6, 0, 11, 3], 12, 9, False, torch.float32, gen)
    args = {"a": a, "b": b, "batch_sizes": torch.tensor([6, 0, 11, 3]), "trans_b": False, **change}
    with pytest.raises(error, match=match):
        ops.gmm(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("trans_b", [False, True])
def test_gpu_gmm_matches_float64(trans_b):
    """DeepSeek-V3 down-projection shape per EP rank (G=32, K=2048, N=7168), bf16."""
    gen = torch.Generator().manual_seed(5)
    splits = gg.skewed_splits(32, 8192)
    a, b, grad = _problem(splits, 2048, 7168, trans_b, torch.bfloat16, gen)
    a, b, grad = a.cuda().requires_grad_(), b.cuda().requires_grad_(), grad.cuda()
    out = ops.gmm(a, b, torch.tensor(splits), trans_b)
    out.backward(grad)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    out64 = ref_gmm(a64, b64, splits, trans_b)
    out64.backward(grad.double())
    print("\nGPU gmm backends:", gg.dispatch_stats()["selected"])
    assert rel_error(out, out64) < 1e-2
    assert rel_error(a.grad, a64.grad) < 1e-2
    assert rel_error(b.grad, b64.grad) < 1e-2


@pytest.mark.parametrize("trans_b", [False, True])
def test_a_recipe_of_another_dtype_names_a(trans_b, gen):
    """A recipe whose dtype ``a`` does not have was reported with the op's own operand
    names (``dy`` / ``x`` and ``w``); gmm's arguments are ``a`` and ``b``."""
    a, b = torch.randn(8, 32, generator=gen), torch.randn(3, 32, 32, generator=gen)
    with pytest.raises(gg.DTypeError, match=r"^a=.*bfloat16"):
        ops.gmm(a, b, torch.tensor([3, 0, 5]), trans_b, recipe="bf16")
