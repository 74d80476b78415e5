"""Every bad input gets a clear error naming the argument, the value and what is allowed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import grouped_gemm as gg
from grouped_gemm.validation import Region, first_overlap


@pytest.fixture
def fwd_args(gen):
    x = torch.randn(10, 32, generator=gen)
    w = torch.randn(3, 16, 32, generator=gen)
    return x, w, [3, 0, 7]


@pytest.mark.parametrize(
    ("splits", "error", "text"),
    [
        ([3, -1, 8], gg.SplitsError, "m_splits[1]=-1"),
        ([3, 0, 6], gg.SplitsError, "sum to 9"),
        ([3, 7], gg.SplitsError, "expected 3, got 2"),
        ([3.0, 0, 7], gg.SplitsError, "m_splits[0]=3.0 is a float"),
        ([True, 2, 7], gg.SplitsError, "is a bool"),
        (["3", 0, 7], gg.SplitsError, "is a str"),
        ("3,0,7", gg.InvalidTypeError, "list/tuple of ints"),
        (torch.tensor([3.0, 0.0, 7.0]), gg.SplitsError, "integer tensor"),
        (torch.tensor([[3, 0, 7]]), gg.SplitsError, "1-D"),
        (torch.tensor([3, 7]), gg.SplitsError, "expected 3, got 2"),
        (torch.tensor([3, -1, 8]), gg.SplitsError, "m_splits[1]=-1"),
    ],
)
def test_bad_splits(fwd_args, splits, error, text):
    x, w, _ = fwd_args
    with pytest.raises(error) as info:
        gg.grouped_gemm(x, w, splits)
    assert "m_splits" in str(info.value)
    assert text in str(info.value)


def test_error_classes_are_value_and_type_errors():
    assert issubclass(gg.SplitsError, ValueError)
    assert issubclass(gg.ShapeError, ValueError)
    assert issubclass(gg.DeviceMismatchError, ValueError)
    assert issubclass(gg.UnknownRecipeError, ValueError)
    assert issubclass(gg.UnknownBackendError, ValueError)
    assert issubclass(gg.DTypeError, TypeError)
    assert issubclass(gg.InvalidTypeError, TypeError)


def test_wrong_ndim(fwd_args):
    x, w, s = fwd_args
    with pytest.raises(gg.ShapeError, match=r"x=.*2-D tensor of shape \(M, K\), got 3-D"):
        gg.grouped_gemm(x[None], w, s)
    with pytest.raises(gg.ShapeError, match=r"w=.*3-D tensor of shape \(G, N, K\), got 2-D"):
        gg.grouped_gemm(x, w[0], s)
    with pytest.raises(gg.InvalidTypeError, match=r"x=.*torch.Tensor"):
        gg.grouped_gemm(x.tolist(), w, s)


def test_k_mismatch(fwd_args):
    x, w, s = fwd_args
    with pytest.raises(gg.ShapeError, match=r"x=.*K=32 to match w \(3, 16, 32\)"):
        gg.grouped_gemm(x[:, :31], w, s)
    dy = torch.randn(10, 15)
    with pytest.raises(gg.ShapeError, match=r"dy=.*N=16"):
        gg.grouped_gemm_dgrad(dy, w, s)


def test_dtype_mismatch_between_x_and_w(fwd_args):
    x, w, s = fwd_args
    """Either operand may be the wrong one, so the message names both dtypes."""
    with pytest.raises(gg.DTypeError, match=r"x is torch.bfloat16 and w is torch.float32"):
        gg.grouped_gemm(x.bfloat16(), w, s)
    with pytest.raises(gg.DTypeError, match=r"dy is torch.float32 and x is torch.bfloat16"):
        gg.grouped_gemm_wgrad(torch.randn(x.shape[0], 16), x.bfloat16(), s)


def test_dtype_against_recipe(fwd_args):
    x, w, s = fwd_args
    with pytest.raises(gg.DTypeError, match=r"recipe bf16 takes bfloat16 operands, but x is torch.float32 and w is"):
        gg.grouped_gemm(x, w, s, recipe="bf16")
    with pytest.raises(gg.DTypeError, match="dtype bfloat16, float16 or float32"):
        gg.grouped_gemm(x.double(), w.double(), s)


def test_operands_on_different_devices(fwd_args):
    x, w, s = fwd_args
    with pytest.raises(gg.DeviceMismatchError, match=r"w=.*device=meta.*on cpu"):
        gg.grouped_gemm(x, w.to("meta"), s)
    with pytest.raises(gg.DeviceMismatchError, match=r"x=.*on cpu"):
        gg.grouped_gemm_wgrad(torch.randn(10, 16), x.to("meta"), s)


def test_weight_list_must_agree(fwd_args):
    x, w, s = fwd_args
    ws = list(w)
    with pytest.raises(gg.ShapeError, match=r"w\[2\]"):
        gg.grouped_gemm(x, [*ws[:2], ws[2][:, :8]], s)
    with pytest.raises(gg.DTypeError, match=r"w\[1\]"):
        gg.grouped_gemm(x, [ws[0], ws[1].double(), ws[2]], s)
    with pytest.raises(gg.InvalidTypeError, match="non-empty list"):
        gg.grouped_gemm(x, [], s)


def test_zero_groups_rejected():
    with pytest.raises(gg.ShapeError, match="at least one group"):
        gg.grouped_gemm(torch.randn(0, 4), torch.randn(0, 4, 4), [])
    with pytest.raises(gg.SplitsError, match="at least one group"):
        gg.grouped_gemm_wgrad(torch.randn(0, 4), torch.randn(0, 4), [])


def test_bad_out(fwd_args):
    x, w, s = fwd_args
    with pytest.raises(gg.ShapeError, match=r"out=.*shape \(M, N\)=\(10, 16\)"):
        gg.grouped_gemm(x, w, s, out=torch.empty(10, 17))
    with pytest.raises(gg.DTypeError, match=r"out=.*out_dtype=torch.float16"):
        gg.grouped_gemm(x, w, s, out=torch.empty(10, 16), out_dtype=torch.float16)
    with pytest.raises(gg.DTypeError, match=r"out=.*bfloat16, float16 or float32"):
        gg.grouped_gemm(x, w, s, out=torch.empty(10, 16, dtype=torch.float64))
    with pytest.raises(gg.DeviceMismatchError, match=r"out=.*on cpu"):
        gg.grouped_gemm(x, w, s, out=torch.empty(10, 16, device="meta"))
    with pytest.raises(gg.InvalidArgumentError, match=r"out=.*contiguous"):
        gg.grouped_gemm(x, w, s, out=torch.empty(16, 10).T)
    with pytest.raises(gg.DTypeError, match="out_dtype"):
        gg.grouped_gemm(x, w, s, out_dtype=torch.int32)


def test_wgrad_out_and_accumulate(gen):
    dy, x = torch.randn(10, 16, generator=gen), torch.randn(10, 32, generator=gen)
    with pytest.raises(gg.InvalidArgumentError, match="accumulate=True needs out="):
        gg.grouped_gemm_wgrad(dy, x, [3, 7], accumulate=True)
    with pytest.raises(gg.ShapeError, match=r"out=.*\(G, N, K\)=\(2, 16, 32\)"):
        gg.grouped_gemm_wgrad(dy, x, [3, 7], out=torch.empty(3, 16, 32))
    with pytest.raises(gg.ShapeError, match=r"out=.*G=2 tensors of shape \(N, K\)=\(16, 32\)"):
        gg.grouped_gemm_wgrad(dy, x, [3, 7], out=[torch.empty(16, 32)] * 3)
    with pytest.raises(gg.ShapeError, match=r"x=.*M=10 rows like dy"):
        gg.grouped_gemm_wgrad(dy, x[:9], [3, 7])
    with pytest.raises(gg.InvalidTypeError, match="accumulate"):
        gg.grouped_gemm_wgrad(dy, x, [3, 7], out=torch.empty(2, 16, 32), accumulate="yes")


def test_unknown_recipe_and_backend(fwd_args):
    x, w, s = fwd_args
    with pytest.raises(gg.UnknownRecipeError, match=r"recipe='fp8'.*known recipes are bf16"):
        gg.grouped_gemm(x, w, s, recipe="fp8")
    with pytest.raises(gg.UnknownBackendError, match=r"backend='nope'.*registered backends are .*reference"):
        gg.grouped_gemm(x, w, s, backend="nope")


def test_recipe_object_may_change_only_scale_rule_and_grad_format():
    custom = gg.get_recipe("mxfp8").model_copy(update={"grad_format": "e5m2"})
    assert gg.get_recipe(custom) is custom
    with pytest.raises(gg.UnknownRecipeError, match="only scale_rule / grad_format"):
        gg.get_recipe(gg.get_recipe("mxfp8").model_copy(update={"act_format": "e2m1"}))


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp32", "a16w4"])
def test_a_grad_format_where_dy_stays_high_precision_is_refused(name, fwd_args):
    """No backend quantizes dy for these recipes: a grad_format set on them was accepted
    and ignored."""
    x, w, s = fwd_args
    recipe = gg.get_recipe(name).model_copy(update={"grad_format": "e4m3"})
    with pytest.raises(gg.UnknownRecipeError, match=rf"^recipe.grad_format='e4m3' is invalid: None for {name}"):
        gg.get_recipe(recipe)
    with pytest.raises(gg.UnknownRecipeError, match=r"^recipe.grad_format="):
        gg.grouped_gemm(x, w, s, recipe=recipe)


def test_errors_name_argument_value_and_allowed():
    err = gg.SplitsError("m_splits", [1, -2], "non-negative group sizes")
    assert err.argument == "m_splits"
    assert err.value == [1, -2]
    assert err.allowed == "non-negative group sizes"
    assert str(err) == "m_splits=[1, -2] is invalid: non-negative group sizes"


def test_first_overlap_matches_every_pair_checked():
    """The one-sweep overlap check finds an overlap of a written region exactly when a
    check of every pair does, on random slices of a few storages, read-only overlaps
    allowed."""
    rng = np.random.default_rng(0)
    pools = [torch.zeros(64), torch.zeros(64)]
    for _ in range(400):
        regions = []
        for i in range(int(rng.integers(1, 7))):
            pool = pools[int(rng.integers(0, 2))]
            start, length = int(rng.integers(0, 60)), int(rng.integers(0, 5))
            regions.append(Region(f"r{i}", pool[start : start + length], bool(rng.integers(0, 2))))

        def shared(a, b):
            x, y = a.tensor, b.tensor
            if x.numel() == 0 or y.numel() == 0 or x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr():
                return False
            return x.data_ptr() < y.data_ptr() + y.nbytes and y.data_ptr() < x.data_ptr() + x.nbytes

        pairs = [(a, b) for i, a in enumerate(regions) for b in regions[i + 1 :] if (a.written or b.written)]
        found = first_overlap(regions)
        assert (found is not None) == any(shared(a, b) for a, b in pairs)
        if found is not None:
            assert found[0].written and shared(*found)


def test_a_wgrad_out_list_is_named_as_out(gen):
    """A mismatched group of wgrad's ``out`` list was described as a weight."""
    dy, x = torch.randn(4, 3, generator=gen), torch.randn(4, 5, generator=gen)
    out = [torch.zeros(3, 5), torch.zeros(3, 5, dtype=torch.bfloat16)]
    with pytest.raises(gg.DTypeError, match=r"^out\[1\]=.*every group's out has dtype torch.float32"):
        gg.grouped_gemm_wgrad(dy, x, [2, 2], out=out)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_nested_operands_are_named_as_nested(gen):
    """A nested weight crashed in torch ("NestedTensorImpl doesn't support sizes") and a
    nested activation was called 3-D (its dim() counts one more than its parts')."""
    x, w = torch.randn(5, 8, generator=gen), torch.randn(2, 4, 8, generator=gen)
    nested_x = torch.nested.nested_tensor([x[:2], x[2:]])
    nested_w = torch.nested.nested_tensor(list(w))
    with pytest.raises(gg.InvalidArgumentError, match=r"^w=Tensor\(nested.*not a nested tensor"):
        gg.grouped_gemm(x, nested_w, [2, 3])
    with pytest.raises(gg.InvalidArgumentError, match=r"^x=Tensor\(nested.*not a nested tensor"):
        gg.grouped_gemm(nested_x, w, [2, 3])
    with pytest.raises(gg.InvalidArgumentError, match=r"^dy=Tensor\(nested.*not a nested tensor"):
        gg.grouped_gemm_wgrad(torch.nested.nested_tensor([w[0], w[1, :1]]), x, [2, 3])
