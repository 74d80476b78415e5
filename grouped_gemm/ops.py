"""``gmm``: a drop-in for the Megatron-style ``grouped_gemm`` package's ``ops.gmm``.

Code written against that package (``from grouped_gemm import ops; ops.gmm(a, b,
batch_sizes, trans_b)``) runs unchanged, through this library's dispatcher, with autograd
and ``torch.compile`` support. Its low-level entry is here too, as ``ops.backend.gmm``
(``grouped_gemm.backend``).

Mapping onto this library's ops, with no copy of ``b`` (``w`` is ``(G, N, K)``, the
``nn.Linear`` layout):

- ``trans_b=True``: ``b`` is ``(G, N, K)`` and ``out_g = a_g @ b_g.T`` is our ``fwd`` with
  ``w = b``.
- ``trans_b=False``: ``b`` is ``(G, K, N)`` and ``out_g = a_g @ b_g``. Our ``dgrad`` computes
  ``dy_g @ w_g`` for ``w`` of shape ``(G, N', K')``; with ``w = b`` (so ``N' = K``,
  ``K' = N``) and ``dy = a`` it is exactly ``a_g @ b_g``.

The backward follows from the ops' registered autograd: for ``trans_b=False``
``grad_a = grad @ b_g.T`` (a ``fwd`` with ``w = b``) and ``grad_b = a_g.T @ grad`` (a
``wgrad`` with ``dy = a``, ``x = grad``, giving ``(G, K, N)``, the layout of ``b``); for
``trans_b=True`` ``grad_a`` is a ``dgrad`` and ``grad_b = grad_g.T @ a_g`` a ``wgrad``.
"""

from __future__ import annotations

from typing import Any

import torch

from grouped_gemm import backend
from grouped_gemm.custom_ops import dgrad_op, fwd_op
from grouped_gemm.errors import DTypeError
from grouped_gemm.linear import split_args
from grouped_gemm.recipe_codec import op_recipe, recipe_from_key
from grouped_gemm.recipes import Recipe
from grouped_gemm.vocabulary import dtype_name

__all__ = ["backend", "gmm"]


def gmm(
    a: torch.Tensor,
    b: torch.Tensor,
    batch_sizes: torch.Tensor | list[int],
    trans_b: bool = False,
    *,
    recipe: str | Recipe | None = None,
) -> torch.Tensor:
    """Grouped ``a @ b``: rows ``[offs[g], offs[g+1])`` of ``a`` ``(M, K)`` times ``b[g]``.

    ``b`` is ``(G, K, N)``, or ``(G, N, K)`` with ``trans_b=True``; ``batch_sizes`` holds G
    row counts (a CPU int64 tensor as in the original package; a device tensor or a list
    also work). Returns ``(M, N)`` in ``a``'s dtype. ``recipe`` (an extension) defaults to
    the plain recipe of ``a``'s dtype.
    """
    backend.check_flag(trans_b, "trans_b")
    backend.check_grouped_operands(a, b, trans_b)
    # Host sizes are read in eager mode only: under torch.compile reading them would break
    # the graph, and the op checks them when it runs.
    sizes = backend.check_batch_sizes(
        batch_sizes, b.shape[0], a.shape[0], a.device, read_host=not torch.compiler.is_compiling()
    )
    key = op_recipe(recipe, a)
    if recipe is not None and not torch.compiler.is_compiling():  # named as gmm's own argument, not the op's
        resolved = recipe_from_key(key)
        if resolved.plain_dtype is not None and dtype_name(a.dtype) != resolved.plain_dtype:
            raise DTypeError("a", a, f"dtype {resolved.plain_dtype}: recipe {resolved.name} computes in it (b like a)")
    splits, splits_tensor = split_args(sizes)
    if trans_b:
        return fwd_op(a, [b], None, splits, splits_tensor, key, None)
    return dgrad_op(a, [b], splits, splits_tensor, key)


def __getattr__(name: str) -> Any:
    raise backend.not_provided("ops", name)
