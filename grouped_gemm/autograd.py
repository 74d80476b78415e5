"""Autograd for grouped GEMMs, in eager mode and under ``torch.compile``.

Two routes share one forward and one backward (``grouped_gemm.linear``):

- ``GroupedLinearFunction`` (eager): a ``torch.autograd.Function`` that can hold what a
  custom op cannot carry: the weight parameters themselves (for ``main_grad`` and
  Megatron's ``grad_added_to_main_grad`` flag), a caller's ``out`` buffer, and a
  ``GroupedLinear``'s explicitly frozen MX weights.
- ``torch.ops.grouped_gemm.*`` (compiled, in ``custom_ops``): ``torch.library`` custom ops with fake
  implementations, so Dynamo sees output shapes without running anything, and with
  autograd registered in terms of each other (fwd <-> dgrad <-> wgrad), so backward and
  double backward trace too.

Both call ``gg.grouped_gemm`` / ``grouped_gemm_dgrad`` / ``grouped_gemm_wgrad`` on the real
tensors at run time, so every call (forward, dgrad, wgrad) is dispatched for its own
problem with the recipe's formats. ``grouped_linear`` picks the route.

MX recipes quantize the master weights inside every call: the forward GEMM quantizes them
blocked along K, dgrad quantizes the *saved* weight blocked along N. So a CUDA graph that
captures a step re-quantizes on replay, and dgrad's copy is always the weight the forward
saw (autograd's saved-tensor version check refuses a weight modified in between).
Quantizing for dgrad in backward rather than in forward costs the same one pass over the
weight, keeps no quantized copy alive from forward to backward, and costs nothing in
forwards that need no gradient.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

from grouped_gemm.custom_ops import fwd_op
from grouped_gemm.errors import DTypeError, InvalidArgumentError, InvalidTypeError
from grouped_gemm.linear import (
    ApiGemms,
    Splits,
    Weights,
    check_layer_bias,
    forward_gemm,
    linear_backward,
    split_args,
    weight_operand,
)
from grouped_gemm.main_grad import fused_grad_placeholder, main_grads
from grouped_gemm.mx import MXTensor
from grouped_gemm.recipe_codec import op_recipe, recipe_from_key
from grouped_gemm.recipes import Recipe
from grouped_gemm.validation import check_no_overlap, snapshot_splits


@dataclasses.dataclass(frozen=True)
class LinearPlan:
    """What ``GroupedLinearFunction`` needs besides tensors.

    ``frozen`` maps ``"fwd"`` / ``"dgrad"`` to weights quantized ahead of time by
    ``GroupedLinear.freeze_quantized_weights`` (an explicit opt-in); an op not in it gets
    the parameters themselves, quantized by the backend inside the call.
    """

    m_splits: Splits
    recipe: Recipe
    fuse_wgrad_accumulation: bool = False
    frozen: Mapping[str, MXTensor] = dataclasses.field(default_factory=dict)

    def weight(self, op: str, weights: Sequence[torch.Tensor]) -> Weights | MXTensor:
        """The weight operand of ``op``: the frozen copy if there is one, else the parameters."""
        frozen = self.frozen.get(op)
        return frozen if frozen is not None else weight_operand(weights)


class GroupedLinearFunction(torch.autograd.Function):
    """``y = x @ w[g].T + bias[g]`` per group, eager. Backward runs dgrad and wgrad as two
    dispatched calls; with fused accumulation wgrad adds into each weight's ``main_grad``.

    ``apply(x, bias, out, plan, *weights)``: ``out`` (or None) receives the result in
    place; ``weights`` is one ``(G, N, K)`` tensor or G ``(N, K)`` tensors.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor | None,
        plan: LinearPlan,
        *weights: torch.Tensor,
    ) -> torch.Tensor:
        y = forward_gemm(x, plan.weight("fwd", weights), bias, plan.m_splits, plan.recipe, out=out)
        if out is not None:
            ctx.mark_dirty(out)
        ctx.save_for_backward(x, *weights)
        ctx.plan = plan
        ctx.context = contextvars.copy_context()
        ctx.params = weights if plan.fuse_wgrad_accumulation else ()
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        # Autograd runs CUDA backward nodes on its own device threads, which do not see
        # the caller's context variables: run in the forward's context, so the dispatch
        # scopes (gg.use_backends) active at forward also steer dgrad and wgrad.
        return ctx.context.run(GroupedLinearFunction._backward, ctx, dy)

    @staticmethod
    def _backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        if torch.is_grad_enabled():
            # create_graph=True: the functional GEMMs below would refuse the weights (they
            # require grad) with an error pointing back at grouped_linear; and a backward
            # run without grad mode would drop this layer's second-order terms silently.
            raise InvalidArgumentError(
                "create_graph",
                True,
                "first-order gradients only: the eager grouped_linear backward is not differentiable; "
                "drop create_graph=True, or for double backward call torch.ops.grouped_gemm.fwd "
                "(what grouped_linear runs under torch.compile)",
            )
        x, *weights = ctx.saved_tensors
        plan: LinearPlan = ctx.plan
        trained = ctx.needs_input_grad[4:]
        need_w = any(trained)
        fused = plan.fuse_wgrad_accumulation and need_w
        if fused:
            requested = _weights_requested(ctx.params, trained)
            need_w = requested is not False  # backward(inputs=...) without the weights: no wgrad
            fused = requested is True  # torch.autograd.grad: the gradients are returned instead
        gemms = ApiGemms(plan.m_splits, plan.recipe, plan.weight("dgrad", weights), ctx.bias_dtype)
        dx, dws, dbias = linear_backward(
            gemms,
            dy,
            x,
            weights,
            need_x=ctx.needs_input_grad[0],
            need_w=need_w,
            need_bias=ctx.needs_input_grad[1],
            main_grad=main_grads(ctx.params, trained) if fused else None,
        )
        if fused:
            dws = [fused_grad_placeholder(p) if t else None for p, t in zip(ctx.params, trained, strict=True)]
        return (dx, dbias, None, None, *dws)


def _weights_requested(params: Sequence[torch.Tensor], trained: Sequence[bool]) -> bool | None:
    """Whether this backward accumulates into the trained weights (fused wgrad adds into their
    ``main_grad`` only then): False for ``backward(inputs=...)`` that leaves them out, True
    for a backward that includes them, None inside ``torch.autograd.grad``, whose engine does
    not say this for leaves (it returns gradients rather than accumulating them)."""
    try:
        return any(
            torch._C._will_engine_execute_node(get_gradient_edge(p).node)
            for p, t in zip(params, trained, strict=True)
            if t
        )
    except RuntimeError:
        return None


def grouped_linear(
    x: torch.Tensor,
    weight: Weights,
    m_splits: Any,
    bias: torch.Tensor | None = None,
    *,
    recipe: str | Recipe | None = None,
    out: torch.Tensor | None = None,
    fuse_wgrad_accumulation: bool = False,
) -> torch.Tensor:
    """Differentiable grouped linear layer: ``y[rows of g] = x[rows of g] @ w[g].T + bias[g]``.

    ``weight`` is ``(G, N, K)`` or a list of G ``(N, K)`` tensors; ``bias`` ``(G, N)``.
    ``fuse_wgrad_accumulation`` adds the weight gradient into each weight's ``main_grad``
    (see ``fused_grad_placeholder`` for what ``.grad`` receives). Eager calls run
    ``GroupedLinearFunction``; under ``torch.compile`` the ``grouped_gemm::fwd`` op, where
    ``out`` is filled by a copy. MX recipes quantize ``weight`` inside every call.
    """
    return run_grouped_linear(x, weight, m_splits, bias, recipe, out, fuse_wgrad_accumulation)


def run_grouped_linear(
    x: torch.Tensor,
    weight: Weights,
    m_splits: Any,
    bias: torch.Tensor | None,
    recipe: str | Recipe | None,
    out: torch.Tensor | None,
    fuse_wgrad_accumulation: bool,
    frozen: Mapping[str, MXTensor] | None = None,
) -> torch.Tensor:
    """``grouped_linear``, plus ``GroupedLinear``'s frozen MX weights (eager only; the
    compiled op always quantizes the parameters it is given)."""
    if not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None:
        raise InvalidArgumentError(
            "grouped_linear",
            "called under a torch.func transform (grad, vmap, jacrev, ...)",
            "plain autograd: the layer's backward runs the dispatcher's GEMMs on real tensors, which "
            "functorch's wrapped tensors are not; use torch.autograd.grad / .backward()",
        )
    key = op_recipe(recipe, x)
    if isinstance(weight, torch.Tensor):
        weights = [weight]
    elif isinstance(weight, (list, tuple)):
        weights = list(weight)
    else:
        raise InvalidTypeError("weight", weight, "a (G, N, K) tensor or a list of G (N, K) tensors")
    if not isinstance(fuse_wgrad_accumulation, bool):
        raise InvalidTypeError("fuse_wgrad_accumulation", fuse_wgrad_accumulation, "True or False")
    m_splits = snapshot_splits(m_splits)
    if bias is not None and weights and isinstance(weights[0], torch.Tensor) and isinstance(x, torch.Tensor):
        check_layer_bias(bias, weights, x)
    if out is not None and not isinstance(out, torch.Tensor):
        # Read below as a tensor: a list or an array failed with a bare AttributeError.
        raise InvalidTypeError("out", out, "a torch.Tensor of shape (M, N), or None")
    if out is not None and out.requires_grad:
        raise InvalidArgumentError("out", out, "a buffer that does not require grad (the result is written into it)")
    if out is not None and isinstance(x, torch.Tensor) and out.dtype != x.dtype:
        # Eager, the forward wrote such a result and its backward then failed on dy's dtype;
        # compiled, it was rounded to x's dtype first: one rule for both.
        raise DTypeError("out", out, f"dtype {x.dtype}, like x (the layer's result)")
    # Only a forward that will produce weight gradients needs the main_grad buffers (an
    # inference or frozen-weight call of a fused layer runs without them, compiled or not).
    trained = [isinstance(w, torch.Tensor) and w.requires_grad for w in weights]
    needs_main_grad = fuse_wgrad_accumulation and torch.is_grad_enabled() and any(trained)
    if torch.compiler.is_compiling():
        splits, splits_tensor = split_args(m_splits)
        bufs = main_grads(weights, trained) if needs_main_grad else None
        y = fwd_op(x, weights, bias, splits, splits_tensor, key, bufs)
        return out.copy_(y) if out is not None else y
    if out is not None and isinstance(bias, torch.Tensor):
        # The GEMM checks out against x and w only; the bias is read after it wrote out.
        # (Compiled, out is filled by a copy after the op: no overlap to refuse.)
        check_no_overlap([out], (("bias", bias),))
    if needs_main_grad:
        main_grads(weights, trained)
    plan = LinearPlan(m_splits, recipe_from_key(key), fuse_wgrad_accumulation, frozen or {})
    return GroupedLinearFunction.apply(x, bias, out, plan, *weights)
