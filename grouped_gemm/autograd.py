"""Autograd for grouped GEMMs, in eager mode and under ``torch.compile``.

Two routes share the helpers at the top of this module:

- ``GroupedLinearFunction`` (eager): a ``torch.autograd.Function`` that can hold what a
  custom op cannot carry: the weight parameters themselves (for ``main_grad`` and
  Megatron's ``grad_added_to_main_grad`` flag), a caller's ``out`` buffer, and cached
  MX-quantized weights.
- ``torch.ops.grouped_gemm.*`` (compiled): ``torch.library`` custom ops with fake
  implementations, so Dynamo sees output shapes without running anything, and with
  autograd registered in terms of each other (fwd <-> dgrad <-> wgrad), so backward and
  double backward trace too.

Both call ``gg.grouped_gemm`` / ``grouped_gemm_dgrad`` / ``grouped_gemm_wgrad`` on the real
tensors at run time, so every call (forward, dgrad, wgrad) is dispatched for its own
problem with the recipe's formats. ``grouped_linear`` picks the route.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from grouped_gemm import api
from grouped_gemm.errors import InvalidArgumentError, InvalidTypeError, UnknownRecipeError
from grouped_gemm.recipes import RECIPES, Recipe, get_recipe

Splits = list[int] | torch.Tensor
Weights = torch.Tensor | list[torch.Tensor]

# --------------------------------------------------------------------------- helpers


_PLAIN_BY_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def recipe_key(recipe: Recipe) -> str:
    """A recipe as the custom ops' string argument: its name, plus the two fields a caller
    may change on a built-in (``"mxfp8;scale_rule=floor;grad_format=e5m2"``).

    Plain attribute reads and string formatting only, so Dynamo traces it (torch 2.11
    cannot trace pydantic's ``__eq__``).
    """
    base = RECIPES.get(recipe.name)
    if base is not None and recipe.scale_rule == base.scale_rule and recipe.grad_format == base.grad_format:
        return recipe.name
    return f"{recipe.name};scale_rule={recipe.scale_rule};grad_format={recipe.grad_format or 'none'}"


@functools.lru_cache(maxsize=64)
def recipe_from_key(key: str) -> Recipe:
    """Inverse of ``recipe_key``; an unknown name raises ``UnknownRecipeError``."""
    name, *changes = key.split(";")
    base = get_recipe(name)
    if not changes:
        return base
    fields = dict(change.partition("=")[::2] for change in changes)
    if fields.keys() != {"scale_rule", "grad_format"}:
        raise UnknownRecipeError("recipe", key, "a recipe name, or name;scale_rule=...;grad_format=...")
    grad_format = None if fields["grad_format"] == "none" else fields["grad_format"]
    return get_recipe(base.model_copy(update={"scale_rule": fields["scale_rule"], "grad_format": grad_format}))


def op_recipe(recipe: str | Recipe | None, x: torch.Tensor) -> str:
    """The recipe string of a call (``recipe=`` or the plain recipe of ``x``'s dtype).

    Checked eagerly; under ``torch.compile`` it only formats (the op checks at run time).
    """
    if recipe is None:
        name = _PLAIN_BY_DTYPE.get(x.dtype) if isinstance(x, torch.Tensor) else None
        if name is None:
            raise InvalidTypeError("x", x, "a bfloat16, float16 or float32 tensor (or pass recipe=)")
        return name
    compiling = torch.compiler.is_compiling()
    if isinstance(recipe, str):
        if not compiling:
            recipe_from_key(recipe)
        return recipe
    if not isinstance(recipe, Recipe):
        raise UnknownRecipeError("recipe", recipe, f"a recipe name ({', '.join(RECIPES)}) or a gg.Recipe")
    return recipe_key(recipe if compiling else get_recipe(recipe))


def split_args(m_splits: Any) -> tuple[list[int] | None, torch.Tensor | None]:
    """``m_splits`` as the custom ops take it: (host list, None) or (None, tensor)."""
    if isinstance(m_splits, torch.Tensor):
        return None, m_splits
    if isinstance(m_splits, (list, tuple)):
        return list(m_splits), None
    raise InvalidTypeError("m_splits", m_splits, "a list/tuple of ints or a 1-D integer tensor")


def _splits(splits: Sequence[int] | None, splits_tensor: torch.Tensor | None) -> Splits:
    return list(splits) if splits is not None else splits_tensor


def _counts(m_splits: Splits, device: torch.device) -> torch.Tensor:
    """Group sizes as an int64 tensor on ``device`` (no host sync for device splits)."""
    if isinstance(m_splits, torch.Tensor):
        return m_splits.to(device=device, dtype=torch.int64)
    return torch.tensor(m_splits, dtype=torch.int64).to(device, non_blocking=True)


def weight_operand(weights: Sequence[torch.Tensor]) -> Weights:
    """The API's weight argument: one ``(G, N, K)`` tensor, or a list of G ``(N, K)``."""
    if len(weights) == 1 and weights[0].dim() == 3:
        return weights[0]
    return list(weights)


def weight_grads(dw: torch.Tensor, weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Gradients for ``weights`` from a stacked ``(G, N, K)`` wgrad (views, no copy)."""
    if len(weights) == 1 and weights[0].dim() == 3:
        return [dw]
    return list(dw.unbind(0))


def add_group_bias_(y: torch.Tensor, bias: torch.Tensor, m_splits: Splits) -> None:
    """``y[rows of g] += bias[g]`` in place, with no host sync.

    The bias is added after the GEMM in ``y``'s dtype, so a bf16 output is rounded twice
    (once by the GEMM, once here): at most one extra half-ulp.
    """
    if y.shape[0]:
        y.add_(torch.repeat_interleave(bias, _counts(m_splits, y.device), dim=0, output_size=y.shape[0]))


def bias_grad(dy: torch.Tensor, m_splits: Splits, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``dbias[g] = sum of dy over the rows of g`` -> ``(G, N)``; zeros for empty groups.

    Summed in fp32 (a bf16 running sum loses most digits past a few hundred rows) with
    ``segment_reduce``, which is deterministic, unlike an atomic ``index_add_``.
    """
    sums = torch.segment_reduce(dy.float(), "sum", lengths=_counts(m_splits, dy.device), axis=0, unsafe=True)
    return sums.to(dtype or dy.dtype)


def forward_gemm(
    x: torch.Tensor,
    w: Any,
    bias: torch.Tensor | None,
    m_splits: Splits,
    recipe: Recipe,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y[rows of g] = x[rows of g] @ w[g].T (+ bias[g])`` through the dispatcher."""
    y = api.grouped_gemm(x, w, m_splits, recipe=recipe, out=out)
    if bias is not None:
        add_group_bias_(y, bias, m_splits)
    return y


_placeholders: dict[tuple, torch.Tensor] = {}


def fused_grad_placeholder(param: torch.Tensor) -> torch.Tensor | None:
    """What a weight's ``.grad`` receives when its gradient went into ``main_grad``.

    Megatron-LM's convention (also TransformerEngine's): a parameter that has the
    attribute ``grad_added_to_main_grad`` gets it set to True and receives a dummy
    gradient (zeroed when it has ``zero_out_wgrad``), so Megatron's grad hooks still
    fire and know not to add it again; any other parameter receives ``None``. The
    dummy is one cached buffer per (shape, dtype, device), never read.
    """
    if not hasattr(param, "grad_added_to_main_grad"):
        return None
    param.grad_added_to_main_grad = True
    key = (tuple(param.shape), param.dtype, param.device)
    dummy = _placeholders.get(key)
    if dummy is None:
        dummy = _placeholders[key] = torch.empty(key[0], dtype=param.dtype, device=param.device)
    if getattr(param, "zero_out_wgrad", False):
        dummy.zero_()
    return dummy.detach()


def main_grads(weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each weight's ``main_grad`` buffer, checked (fused wgrad accumulation adds into them)."""
    found = []
    for i, w in enumerate(weights):
        name = "weight.main_grad" if len(weights) == 1 else f"weight{i}.main_grad"
        buf = getattr(w, "main_grad", None)
        if not isinstance(buf, torch.Tensor):
            raise InvalidArgumentError(
                name, buf, "a tensor of the weight's shape (fuse_wgrad_accumulation adds wgrad into it)"
            )
        if buf.shape != w.shape or buf.device != w.device:
            raise InvalidArgumentError(name, buf, f"shape {tuple(w.shape)} on {w.device}, like the weight")
        found.append(buf)
    return found


# --------------------------------------------------------------------------- eager route


@dataclasses.dataclass(frozen=True)
class LinearPlan:
    """What ``GroupedLinearFunction`` needs besides tensors.

    ``weight_for(op)`` returns the weight operand for ``"fwd"`` or ``"dgrad"``: the
    parameters themselves, or a cached MX-quantized copy (see ``GroupedLinear``).
    """

    m_splits: Splits
    recipe: Recipe
    fuse_wgrad_accumulation: bool = False
    weight_for: Callable[[str], Any] | None = None


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
        w = plan.weight_for("fwd") if plan.weight_for else weight_operand(weights)
        y = forward_gemm(x, w, bias, plan.m_splits, plan.recipe, out=out)
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
        x, *weights = ctx.saved_tensors
        plan: LinearPlan = ctx.plan
        dy = dy.contiguous()
        need_x, need_bias = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_w = any(ctx.needs_input_grad[4:])
        dx = dbias = None
        dws: list[torch.Tensor | None] = [None] * len(weights)
        if need_x:
            w = plan.weight_for("dgrad") if plan.weight_for else weight_operand(weights)
            dx = api.grouped_gemm_dgrad(dy, w, plan.m_splits, recipe=plan.recipe)
        if plan.fuse_wgrad_accumulation and need_w:
            bufs = main_grads(ctx.params)
            target = bufs[0] if len(bufs) == 1 and bufs[0].dim() == 3 else bufs
            api.grouped_gemm_wgrad(dy, x, plan.m_splits, recipe=plan.recipe, out=target, accumulate=True)
            dws = [fused_grad_placeholder(p) for p in ctx.params]
        elif need_w:
            dws = weight_grads(api.grouped_gemm_wgrad(dy, x, plan.m_splits, recipe=plan.recipe), weights)
        if need_bias:
            dbias = bias_grad(dy, plan.m_splits, ctx.bias_dtype)
        return (dx, dbias, None, None, *dws)


# --------------------------------------------------------------------------- custom ops

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
    return forward_gemm(x, weight_operand(w), bias, _splits(splits, splits_tensor), recipe_from_key(recipe))


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
    return api.grouped_gemm_dgrad(dy, weight_operand(w), _splits(splits, splits_tensor), recipe=recipe_from_key(recipe))


dgrad_op = torch.library.custom_op(
    "grouped_gemm::dgrad", _dgrad_impl, mutates_args=(), schema=f"(Tensor dy, Tensor[] w, {_SPLITS}) -> Tensor"
)
dgrad_op.__doc__ = "``dx[rows of g] = dy[rows of g] @ w[g]``."


def _wgrad_impl(
    dy: torch.Tensor, x: torch.Tensor, splits: Sequence[int] | None, splits_tensor: torch.Tensor | None, recipe: str
) -> torch.Tensor:
    return api.grouped_gemm_wgrad(dy, x, _splits(splits, splits_tensor), recipe=recipe_from_key(recipe))


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
    target = main_grad[0] if len(main_grad) == 1 and main_grad[0].dim() == 3 else list(main_grad)
    api.grouped_gemm_wgrad(
        dy, x, _splits(splits, splits_tensor), recipe=recipe_from_key(recipe), out=target, accumulate=True
    )


wgrad_accumulate_op = torch.library.custom_op(
    "grouped_gemm::wgrad_accumulate_",
    _wgrad_accumulate_impl,
    mutates_args=("main_grad",),
    schema=f"(Tensor dy, Tensor x, {_SPLITS}, Tensor(a!)[] main_grad) -> ()",
)
wgrad_accumulate_op.__doc__ = "``main_grad[g] += dy[rows of g].T @ x[rows of g]`` in place."


def _bias_grad_impl(dy: torch.Tensor, splits: Sequence[int] | None, splits_tensor: torch.Tensor | None) -> torch.Tensor:
    return bias_grad(dy, _splits(splits, splits_tensor))


bias_grad_op = torch.library.custom_op(
    "grouped_gemm::bias_grad",
    _bias_grad_impl,
    mutates_args=(),
    schema="(Tensor dy, SymInt[]? splits, Tensor? splits_tensor) -> Tensor",
)
bias_grad_op.__doc__ = "``dbias[g] = sum of dy[rows of g]`` -> ``(G, N)``, summed in fp32."


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
    return dy.new_empty((_groups(splits, splits_tensor), dy.shape[1]))


def _fwd_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, w, _, splits, splits_tensor, recipe, main_grad = inputs
    ctx.save_for_backward(x, splits_tensor, *w, *(main_grad or ()))
    ctx.splits, ctx.recipe, ctx.n_w = splits, recipe, len(w)
    ctx.fused = main_grad is not None


def _fwd_backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
    x, splits_tensor, *rest = ctx.saved_tensors
    w, bufs = rest[: ctx.n_w], rest[ctx.n_w :]
    need_x, need_w, need_bias = ctx.needs_input_grad[:3]
    dy = dy.contiguous()
    dx = dbias = None
    dw: list[torch.Tensor | None] = [None] * len(w)
    if need_x:
        dx = dgrad_op(dy, w, ctx.splits, splits_tensor, ctx.recipe)
    if ctx.fused:
        wgrad_accumulate_op(dy, x, ctx.splits, splits_tensor, ctx.recipe, bufs)
    elif any(need_w):
        dw = weight_grads(wgrad_op(dy, x, ctx.splits, splits_tensor, ctx.recipe), w)
    if need_bias:
        dbias = bias_grad_op(dy, ctx.splits, splits_tensor)
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


# --------------------------------------------------------------------------- entry point


def grouped_linear(
    x: torch.Tensor,
    weight: Weights,
    m_splits: Any,
    bias: torch.Tensor | None = None,
    *,
    recipe: str | Recipe | None = None,
    out: torch.Tensor | None = None,
    fuse_wgrad_accumulation: bool = False,
    weight_for: Callable[[str], Any] | None = None,
) -> torch.Tensor:
    """Differentiable grouped linear layer: ``y[rows of g] = x[rows of g] @ w[g].T + bias[g]``.

    ``weight`` is ``(G, N, K)`` or a list of G ``(N, K)`` tensors; ``bias`` ``(G, N)``.
    ``fuse_wgrad_accumulation`` adds the weight gradient into each weight's ``main_grad``
    (see ``fused_grad_placeholder`` for what ``.grad`` receives). Eager calls run
    ``GroupedLinearFunction``; under ``torch.compile`` the ``grouped_gemm::fwd`` op, where
    ``out`` is filled by a copy and ``weight_for`` (cached quantized weights) is not used.
    """
    key = op_recipe(recipe, x)
    weights = [weight] if isinstance(weight, torch.Tensor) else list(weight)
    if out is not None and out.requires_grad:
        raise InvalidArgumentError("out", out, "a buffer that does not require grad (the result is written into it)")
    if torch.compiler.is_compiling():
        splits, splits_tensor = split_args(m_splits)
        bufs = main_grads(weights) if fuse_wgrad_accumulation else None
        y = fwd_op(x, weights, bias, splits, splits_tensor, key, bufs)
        return out.copy_(y) if out is not None else y
    if fuse_wgrad_accumulation and torch.is_grad_enabled() and any(w.requires_grad for w in weights):
        main_grads(weights)
    plan = LinearPlan(m_splits, recipe_from_key(key), fuse_wgrad_accumulation, weight_for)
    return GroupedLinearFunction.apply(x, bias, out, plan, *weights)
