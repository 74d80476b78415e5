"""Pieces shared by the eager and the compiled grouped-linear routes.

Recipes travel as strings (``recipe_key``) because Dynamo cannot trace pydantic objects;
splits as a host list or a device tensor; biases are added and reduced per group here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from grouped_gemm import api
from grouped_gemm.errors import InvalidArgumentError, InvalidTypeError, UnknownRecipeError
from grouped_gemm.group_offsets import GroupOffsets
from grouped_gemm.recipes import RECIPES, Recipe, get_recipe

Splits = list[int] | torch.Tensor | GroupOffsets
Weights = torch.Tensor | list[torch.Tensor]

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
    """``m_splits`` as the custom ops take it: (host list, None) or (None, tensor).

    A ``GroupOffsets`` passes its ``splits`` tensor (an op's schema carries tensors, not the
    object), so under ``torch.compile`` the ends are recomputed by each call."""
    if type(m_splits) is GroupOffsets:
        return None, m_splits.splits
    if isinstance(m_splits, torch.Tensor):
        return None, m_splits
    if isinstance(m_splits, (list, tuple)):
        return list(m_splits), None
    raise InvalidTypeError("m_splits", m_splits, "a list/tuple of ints, a 1-D integer tensor or gg.offsets(...)")


def splits_from_args(splits: Sequence[int] | None, splits_tensor: torch.Tensor | None) -> Splits:
    return list(splits) if splits is not None else splits_tensor


def _counts(m_splits: Splits, device: torch.device) -> torch.Tensor:
    """Group sizes as an int64 tensor on ``device`` (no host sync for device splits)."""
    if type(m_splits) is GroupOffsets:
        m_splits = m_splits.splits
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
