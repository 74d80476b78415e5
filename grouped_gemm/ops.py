"""``gmm``: a drop-in for the Megatron-style ``grouped_gemm`` package's ``ops.gmm``.

Code written against that package (``from grouped_gemm import ops; ops.gmm(a, b,
batch_sizes, trans_b)``) runs unchanged, through this library's dispatcher, with autograd
and ``torch.compile`` support.

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

from grouped_gemm.custom_ops import dgrad_op, fwd_op
from grouped_gemm.errors import DeviceMismatchError, DTypeError, InvalidTypeError, ShapeError, SplitsError
from grouped_gemm.linear_math import op_recipe, split_args
from grouped_gemm.recipes import Recipe

_INT_DTYPES = (torch.int32, torch.int64)


def _check(a: Any, b: Any, batch_sizes: Any, trans_b: Any) -> None:
    """Errors in the drop-in's own argument names (a, b, batch_sizes, trans_b).

    Host batch sizes are read here in eager mode only: under ``torch.compile`` reading them
    would break the graph, and the dispatcher checks them when the op runs.
    """
    if not isinstance(trans_b, bool):
        raise InvalidTypeError("trans_b", trans_b, "True or False")
    if not isinstance(a, torch.Tensor) or a.dim() != 2:
        raise ShapeError("a", a, "a 2-D tensor (M, K)")
    dims = "(G, N, K)" if trans_b else "(G, K, N)"
    if not isinstance(b, torch.Tensor) or b.dim() != 3:
        raise ShapeError("b", b, f"a 3-D tensor {dims}")
    k = b.shape[2] if trans_b else b.shape[1]
    if a.shape[1] != k:
        raise ShapeError("b", b, f"shape {dims} with K={a.shape[1]} (a's columns), trans_b={trans_b}")
    if b.dtype != a.dtype:
        raise DTypeError("b", b, f"dtype {a.dtype}, like a")
    if b.device != a.device:
        raise DeviceMismatchError("b", b, f"a tensor on {a.device}, like a")
    if isinstance(batch_sizes, torch.Tensor):
        if batch_sizes.dim() != 1 or batch_sizes.dtype not in _INT_DTYPES:
            raise SplitsError("batch_sizes", batch_sizes, "a 1-D int64 (or int32) tensor, one entry per group")
        if batch_sizes.numel() != b.shape[0]:
            raise SplitsError("batch_sizes", batch_sizes, f"{b.shape[0]} entries, one per group of b")
        if batch_sizes.device.type == "cpu" and not torch.compiler.is_compiling():
            sizes = batch_sizes.tolist()
            if min(sizes) < 0 or sum(sizes) != a.shape[0]:
                raise SplitsError("batch_sizes", sizes, f"non-negative group sizes summing to a.shape[0]={a.shape[0]}")
    elif not isinstance(batch_sizes, (list, tuple)):
        raise InvalidTypeError("batch_sizes", batch_sizes, "a 1-D int64 CPU tensor (or a list of ints)")


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
    _check(a, b, batch_sizes, trans_b)
    key = op_recipe(recipe, a)
    splits, splits_tensor = split_args(batch_sizes)
    if trans_b:
        return fwd_op(a, [b], None, splits, splits_tensor, key, None)
    return dgrad_op(a, [b], splits, splits_tensor, key)
