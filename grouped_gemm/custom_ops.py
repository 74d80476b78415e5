"""``torch.ops.grouped_gemm.*``: the grouped-linear GEMMs as ``torch.library`` custom ops.

Fake implementations let Dynamo see output shapes without running anything; autograd is
registered in terms of each other (fwd <-> dgrad <-> wgrad) so backward and double
backward trace too. At run time each op dispatches its real problem through the API.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from grouped_gemm import api
from grouped_gemm.linear import (
    bias_grad,
    check_layer_bias,
    forward_gemm,
    linear_backward,
    splits_from_args,
    weight_grads,
    weight_operand,
)
from grouped_gemm.main_grad import accumulate_wgrad, check_no_aliasing
from grouped_gemm.recipe_codec import recipe_from_key
from grouped_gemm.validation import check_tensor, group_count, splits_operand

_SPLITS = "SymInt[]? splits, Tensor? splits_tensor, str recipe"


def _fwd_impl(
    x: torch.Tensor,
    w: list[torch.Tensor],
    bias: torch.Tensor | None,
    splits: Sequence[int] | None,
    splits_tensor: torch.Tensor | None,
    recipe: str,
    main_grad: list[torch.Tensor] | None,
) -> torch.Tensor:
    if main_grad is not None:
        check_no_aliasing(w, main_grad)  # here at run time: a compiled graph cannot read pointers
    if bias is not None:
        check_layer_bias(bias, w, x)
    return forward_gemm(x, weight_operand(w), bias, splits_from_args(splits, splits_tensor), recipe_from_key(recipe))


fwd_op = torch.library.custom_op(
    "grouped_gemm::fwd",
    _fwd_impl,
    mutates_args=(),
    schema=f"(Tensor x, Tensor[] w, Tensor? bias, {_SPLITS}, Tensor[]? main_grad) -> Tensor",
)
fwd_op.__doc__ = """``y[rows of g] = x[rows of g] @ w[g].T (+ bias[g])``; with ``main_grad`` the
backward adds wgrad into those buffers and gives the weights no gradient."""


def _dgrad_impl(
    dy: torch.Tensor,
    w: list[torch.Tensor],
    splits: Sequence[int] | None,
    splits_tensor: torch.Tensor | None,
    recipe: str,
) -> torch.Tensor:
    return api.grouped_gemm_dgrad(
        dy, weight_operand(w), splits_from_args(splits, splits_tensor), recipe=recipe_from_key(recipe)
    )


dgrad_op = torch.library.custom_op(
    "grouped_gemm::dgrad", _dgrad_impl, mutates_args=(), schema=f"(Tensor dy, Tensor[] w, {_SPLITS}) -> Tensor"
)
dgrad_op.__doc__ = "``dx[rows of g] = dy[rows of g] @ w[g]``."


def _wgrad_impl(
    dy: torch.Tensor, x: torch.Tensor, splits: Sequence[int] | None, splits_tensor: torch.Tensor | None, recipe: str
) -> torch.Tensor:
    return api.grouped_gemm_wgrad(dy, x, splits_from_args(splits, splits_tensor), recipe=recipe_from_key(recipe))


wgrad_op = torch.library.custom_op(
    "grouped_gemm::wgrad", _wgrad_impl, mutates_args=(), schema=f"(Tensor dy, Tensor x, {_SPLITS}) -> Tensor"
)
wgrad_op.__doc__ = "``dw[g] = dy[rows of g].T @ x[rows of g]`` -> ``(G, N, K)``."


def _wgrad_accumulate_impl(
    dy: torch.Tensor,
    x: torch.Tensor,
    splits: Sequence[int] | None,
    splits_tensor: torch.Tensor | None,
    recipe: str,
    main_grad: list[torch.Tensor],
) -> None:
    accumulate_wgrad(dy, x, splits_from_args(splits, splits_tensor), recipe_from_key(recipe), main_grad)


wgrad_accumulate_op = torch.library.custom_op(
    "grouped_gemm::wgrad_accumulate_",
    _wgrad_accumulate_impl,
    mutates_args=("main_grad",),
    schema=f"(Tensor dy, Tensor x, {_SPLITS}, Tensor(a!)[] main_grad) -> ()",
)
wgrad_accumulate_op.__doc__ = "``main_grad[g] += dy[rows of g].T @ x[rows of g]`` in place."


def _bias_grad_impl(dy: torch.Tensor, splits: Sequence[int] | None, splits_tensor: torch.Tensor | None) -> torch.Tensor:
    # Checked like the GEMM ops' splits: segment_reduce(unsafe=True) trusts the lengths, and
    # a sum past dy's rows would read out of bounds.
    m_splits = splits_from_args(splits, splits_tensor)
    check_tensor(dy, "dy", 2, "(M, N)")
    splits_operand(m_splits, group_count(m_splits), dy.shape[0], "dy", dy.device)
    # fp32 whatever dy is: autograd casts it to the bias's dtype, so an fp32 bias of a bf16
    # layer gets the fp32 sum (as eager does), not one rounded to bf16 on the way.
    return bias_grad(dy, m_splits, torch.float32)


bias_grad_op = torch.library.custom_op(
    "grouped_gemm::bias_grad",
    _bias_grad_impl,
    mutates_args=(),
    schema="(Tensor dy, SymInt[]? splits, Tensor? splits_tensor) -> Tensor",
)
bias_grad_op.__doc__ = "``dbias[g] = sum of dy[rows of g]`` -> ``(G, N)`` float32, summed in fp32."


def _groups(splits: Sequence[int] | None, splits_tensor: torch.Tensor | None) -> Any:
    return len(splits) if splits is not None else splits_tensor.shape[0]


@fwd_op.register_fake
def _fwd_fake(
    x: torch.Tensor,
    w: list[torch.Tensor],
    bias: torch.Tensor | None,
    splits: Sequence[int] | None,
    splits_tensor: torch.Tensor | None,
    recipe: str,
    main_grad: list[torch.Tensor] | None,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], w[0].shape[-2]))


@dgrad_op.register_fake
def _dgrad_fake(
    dy: torch.Tensor,
    w: list[torch.Tensor],
    splits: Sequence[int] | None,
    splits_tensor: torch.Tensor | None,
    recipe: str,
) -> torch.Tensor:
    return dy.new_empty((dy.shape[0], w[0].shape[-1]))


@wgrad_op.register_fake
def _wgrad_fake(
    dy: torch.Tensor, x: torch.Tensor, splits: Sequence[int] | None, splits_tensor: torch.Tensor | None, recipe: str
) -> torch.Tensor:
    return dy.new_empty((_groups(splits, splits_tensor), dy.shape[1], x.shape[1]))


@wgrad_accumulate_op.register_fake
def _wgrad_accumulate_fake(
    dy: torch.Tensor,
    x: torch.Tensor,
    splits: Sequence[int] | None,
    splits_tensor: torch.Tensor | None,
    recipe: str,
    main_grad: list[torch.Tensor],
) -> None:
    return None


@bias_grad_op.register_fake
def _bias_grad_fake(dy: torch.Tensor, splits: Sequence[int] | None, splits_tensor: torch.Tensor | None) -> torch.Tensor:
    return dy.new_empty((_groups(splits, splits_tensor), dy.shape[1]), dtype=torch.float32)


def _fwd_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, w, _, splits, splits_tensor, recipe, main_grad = inputs
    ctx.save_for_backward(x, splits_tensor, *w, *(main_grad or ()))
    ctx.splits, ctx.recipe, ctx.n_w = splits, recipe, len(w)
    ctx.fused = main_grad is not None


@dataclasses.dataclass(frozen=True)
class _OpGemms:
    """``linear.BackwardGemms`` as the custom ops, so that the backward traces."""

    w: Sequence[torch.Tensor]
    splits: Sequence[int] | None
    splits_tensor: torch.Tensor | None
    recipe: str

    def dgrad(self, dy: torch.Tensor) -> torch.Tensor:
        return dgrad_op(dy, self.w, self.splits, self.splits_tensor, self.recipe)

    def wgrad(self, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return wgrad_op(dy, x, self.splits, self.splits_tensor, self.recipe)

    def wgrad_accumulate(self, dy: torch.Tensor, x: torch.Tensor, bufs: Sequence[torch.Tensor]) -> None:
        wgrad_accumulate_op(dy, x, self.splits, self.splits_tensor, self.recipe, bufs)

    def bias_grad(self, dy: torch.Tensor) -> torch.Tensor:
        return bias_grad_op(dy, self.splits, self.splits_tensor)


def _fwd_backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
    x, splits_tensor, *rest = ctx.saved_tensors
    w, bufs = rest[: ctx.n_w], rest[ctx.n_w :]
    need_x, need_w, need_bias = ctx.needs_input_grad[:3]
    dx, dw, dbias = linear_backward(
        _OpGemms(w, ctx.splits, splits_tensor, ctx.recipe),
        dy,
        x,
        w,
        need_x=need_x,
        need_w=any(need_w),
        need_bias=need_bias,
        main_grad=bufs if ctx.fused else None,
    )
    return dx, dw, dbias, None, None, None, [None] * len(bufs) if ctx.fused else None


def _dgrad_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    dy, w, splits, splits_tensor, recipe = inputs
    ctx.save_for_backward(dy, splits_tensor, *w)
    ctx.splits, ctx.recipe = splits, recipe


def _dgrad_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    """dx = dy @ w[g]  =>  d(dy) = grad @ w[g].T (a fwd), dw[g] = dy.T @ grad (a wgrad)."""
    dy, splits_tensor, *w = ctx.saved_tensors
    grad = grad.contiguous()
    d_dy = None
    dw: list[torch.Tensor | None] = [None] * len(w)
    if ctx.needs_input_grad[0]:
        d_dy = fwd_op(grad, w, None, ctx.splits, splits_tensor, ctx.recipe, None)
    if any(ctx.needs_input_grad[1]):
        dw = weight_grads(wgrad_op(dy, grad, ctx.splits, splits_tensor, ctx.recipe), w)
    return d_dy, dw, None, None, None


def _wgrad_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    dy, x, splits, splits_tensor, recipe = inputs
    ctx.save_for_backward(dy, x, splits_tensor)
    ctx.splits, ctx.recipe = splits, recipe


def _wgrad_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    """dw[g] = dy.T @ x  =>  d(dy) = x @ grad[g].T (a fwd), dx = dy @ grad[g] (a dgrad)."""
    dy, x, splits_tensor = ctx.saved_tensors
    grad = grad.contiguous()
    d_dy = dx = None
    if ctx.needs_input_grad[0]:
        d_dy = fwd_op(x, [grad], None, ctx.splits, splits_tensor, ctx.recipe, None)
    if ctx.needs_input_grad[1]:
        dx = dgrad_op(dy, [grad], ctx.splits, splits_tensor, ctx.recipe)
    return d_dy, dx, None, None, None


fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup)
dgrad_op.register_autograd(_dgrad_backward, setup_context=_dgrad_setup)
wgrad_op.register_autograd(_wgrad_backward, setup_context=_wgrad_setup)
