"""Recipes: the number formats of a grouped GEMM's operands and gradients.

A recipe fixes what the activations, weights and gradients are quantized to, and how MX
block scales are chosen. Plain recipes (``bf16``, ``fp16``, ``fp32``) take tensors of
that dtype as they are. MX recipes take bf16 / fp16 / fp32 tensors (quantized by the
backend as the recipe says) or already-quantized ``MXTensor`` operands.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from grouped_gemm.errors import UnknownRecipeError
from grouped_gemm.vocabulary import DTypeName

ScaleRule = Literal["rceil", "floor", "even"]
ElementFormat = Literal["e4m3", "e5m2", "e2m1"]


class Recipe(BaseModel):
    """Operand formats of one recipe. ``None`` as a format means "kept in high precision".

    ``grad_format`` is what ``dy`` is quantized to in dgrad / wgrad; ``scale_rule`` how
    every MX block scale is chosen (see ``grouped_gemm.mx``).
    """

    model_config = ConfigDict(frozen=True)

    name: str
    plain_dtype: DTypeName | None = None
    act_format: ElementFormat | None = None
    weight_format: ElementFormat | None = None
    grad_format: ElementFormat | None = None
    scale_rule: ScaleRule = "rceil"
    block_size: int = 32

    @property
    def is_mx(self) -> bool:
        """True for recipes with at least one MX-quantized operand."""
        return self.plain_dtype is None


RECIPES: dict[str, Recipe] = {
    "bf16": Recipe(name="bf16", plain_dtype="bfloat16"),
    "fp16": Recipe(name="fp16", plain_dtype="float16"),
    "fp32": Recipe(name="fp32", plain_dtype="float32"),
    "mxfp8": Recipe(name="mxfp8", act_format="e4m3", weight_format="e4m3", grad_format="e4m3"),
    "mxfp4": Recipe(name="mxfp4", act_format="e2m1", weight_format="e2m1", grad_format="e2m1"),
    "a8w4": Recipe(name="a8w4", act_format="e4m3", weight_format="e2m1", grad_format="e4m3"),
    "a16w4": Recipe(name="a16w4", weight_format="e2m1"),
}

_PLAIN_RECIPE_BY_DTYPE_NAME = {r.plain_dtype: r for r in RECIPES.values() if r.plain_dtype}


def get_recipe(recipe: str | Recipe) -> Recipe:
    """The Recipe for a name, or a Recipe object checked against its built-in namesake.

    A Recipe object may change a built-in recipe's ``scale_rule`` and ``grad_format``
    (e.g. ``get_recipe("mxfp8").model_copy(update={"grad_format": "e5m2"})``); its
    name and operand formats must stay those of the built-in, and ``grad_format`` stays
    None where the built-in keeps dy in high precision (the plain recipes, a16w4).
    """
    if type(recipe) is str:  # a built-in's name, as backends ask per call: one lookup
        found = RECIPES.get(recipe)
        if found is not None:
            return found
    if isinstance(recipe, Recipe):
        # model_copy(update=...) skips validation: re-validate, or a bogus scale_rule
        # would only fail inside a backend.
        try:
            Recipe.model_validate(recipe.model_dump())
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"])
            raise UnknownRecipeError(f"recipe.{field}", first.get("input"), first["msg"]) from None
        base = RECIPES.get(recipe.name)
        same = base is not None and all(
            getattr(recipe, f) == getattr(base, f) for f in ("plain_dtype", "act_format", "weight_format", "block_size")
        )
        if not same:
            raise UnknownRecipeError(
                "recipe",
                recipe,
                f"a built-in recipe ({', '.join(RECIPES)}) with only scale_rule / grad_format changed",
            )
        if base.grad_format is None and recipe.grad_format is not None:
            # The built-in keeps dy in high precision: no backend would quantize it.
            raise UnknownRecipeError(
                "recipe.grad_format",
                recipe.grad_format,
                f"None for {base.name}, whose dy stays in high precision (grad_format applies to "
                f"{', '.join(r.name for r in RECIPES.values() if r.grad_format)})",
            )
        return recipe
    found = RECIPES.get(recipe) if isinstance(recipe, str) else None
    if found is None:
        raise UnknownRecipeError("recipe", recipe, f"known recipes are {', '.join(RECIPES)} (or a gg.Recipe)")
    return found


def plain_recipe_for(dtype_name: str) -> Recipe | None:
    """The plain recipe whose dtype is ``dtype_name`` (``"bfloat16"`` -> bf16), if any."""
    return _PLAIN_RECIPE_BY_DTYPE_NAME.get(dtype_name)
