"""Recipes as strings, for the custom ops and Dynamo.

``torch.library`` ops take strings, not pydantic objects, and Dynamo cannot trace
pydantic's ``__eq__``: a recipe travels as ``recipe_key(recipe)`` and is rebuilt with
``recipe_from_key``.
"""

from __future__ import annotations

import functools

import torch

from grouped_gemm.errors import InvalidTypeError, UnknownRecipeError
from grouped_gemm.recipes import RECIPES, Recipe, get_recipe
from grouped_gemm.vocabulary import FLOAT_DTYPES

#: The plain recipe's name for each float dtype (torch.bfloat16 -> "bf16"); a dict of
#: constants, so Dynamo traces the lookup.
_PLAIN_BY_DTYPE = {FLOAT_DTYPES[r.plain_dtype]: r.name for r in RECIPES.values() if r.plain_dtype}


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
    # Each field once: a repeated one would silently take its last value.
    if len(changes) != len(fields) or fields.keys() != {"scale_rule", "grad_format"}:
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
    if compiling:
        _check_keyless_fields(recipe)
        return recipe_key(recipe)
    return recipe_key(get_recipe(recipe))


def _check_keyless_fields(recipe: Recipe) -> None:
    """Under ``torch.compile``, where ``get_recipe`` cannot run, the part of its check that
    the key depends on: a built-in's name with another block size or operand format made
    the built-in's key, and the op ran the built-in silently (eager refuses it). A name
    or scale_rule / grad_format the key carries is checked by the op when it runs.
    Plain attribute reads and a field's own value in the error: Dynamo traces neither
    ``getattr`` on a pydantic model nor its ``repr``."""
    base = RECIPES.get(recipe.name)
    if base is None:
        return
    fields = (
        ("plain_dtype", recipe.plain_dtype, base.plain_dtype),
        ("act_format", recipe.act_format, base.act_format),
        ("weight_format", recipe.weight_format, base.weight_format),
        ("block_size", recipe.block_size, base.block_size),
    )
    for name, value, builtin in fields:
        if value != builtin:
            raise UnknownRecipeError(
                f"recipe.{name}",
                value,
                f"{builtin!r}, built-in {base.name}'s (a Recipe may change only scale_rule and grad_format)",
            )
