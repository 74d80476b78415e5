"""Grouped linear's math, written once for the eager and the compiled route.

``y[rows of g] = x[rows of g] @ w[g].T + bias[g]``: ``forward_gemm`` runs the forward and
``linear_backward`` decides and runs the backward (dgrad, wgrad or wgrad accumulated
into ``main_grad``, bias gradient). Both routes call them: ``GroupedLinearFunction``
(``grouped_gemm.autograd``, eager) with GEMMs that call the API (``ApiGemms``), and the
``grouped_gemm::fwd`` op's registered autograd (``grouped_gemm.custom_ops``, under
``torch.compile``) with GEMMs that call the custom ops. Also here: how splits travel
through the custom ops' schemas, and the per-group bias.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from grouped_gemm import api
from grouped_gemm.errors import InvalidArgumentError, InvalidTypeError
from grouped_gemm.group_offsets import GroupOffsets
from grouped_gemm.main_grad import accumulate_wgrad
from grouped_gemm.mx import MXTensor
from grouped_gemm.recipes import Recipe
from grouped_gemm.validation import check_bias

Splits = list[int] | torch.Tensor | GroupOffsets
Weights = torch.Tensor | list[torch.Tensor]


# --- Splits through the custom ops' schemas ---------------------------------------------


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
    """Inverse of ``split_args``. The ops take exactly one: given both, which would win is
    a guess (they may disagree), so that is refused."""
    if splits is not None and splits_tensor is not None:
        raise InvalidArgumentError(
            "splits_tensor", splits_tensor, "None when splits is given (the ops take exactly one of the two)"
        )
    return list(splits) if splits is not None else splits_tensor


def _counts(m_splits: Splits, device: torch.device) -> torch.Tensor:
    """Group sizes as an int64 tensor on ``device`` (no host sync for device splits)."""
    if type(m_splits) is GroupOffsets:
        m_splits = m_splits.splits
    if isinstance(m_splits, torch.Tensor):
        return m_splits.to(device=device, dtype=torch.int64)
    return torch.tensor(m_splits, dtype=torch.int64, device="cpu").to(device, non_blocking=True)


# --- Weights ----------------------------------------------------------------------------


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


# --- Bias -------------------------------------------------------------------------------


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


# --- Forward and backward ---------------------------------------------------------------


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


def check_layer_bias(bias: Any, weights: Sequence[torch.Tensor], x: torch.Tensor) -> None:
    """``check_bias`` against the layer's G and N (one ``(G, N, K)`` weight or G ``(N, K)``
    ones), before any GEMM runs: ``add_group_bias_`` would broadcast a ``(G, 1)`` bias."""
    w0 = weights[0]
    check_bias(bias, w0.shape[0] if w0.dim() == 3 else len(weights), w0.shape[-2], x)


class BackwardGemms(Protocol):
    """The GEMMs of one grouped-linear backward, bound to its splits, recipe and weights."""

    def dgrad(self, dy: torch.Tensor) -> torch.Tensor:
        """``dx[rows of g] = dy[rows of g] @ w[g]``."""
        ...

    def wgrad(self, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``dw[g] = dy[rows of g].T @ x[rows of g]`` -> ``(G, N, K)``."""
        ...

    def wgrad_accumulate(self, dy: torch.Tensor, x: torch.Tensor, bufs: Sequence[torch.Tensor]) -> None:
        """``bufs[g] += dy[rows of g].T @ x[rows of g]`` (``main_grad``)."""
        ...

    def bias_grad(self, dy: torch.Tensor) -> torch.Tensor:
        """``dbias[g] = sum of dy[rows of g]`` -> ``(G, N)``."""
        ...


@dataclasses.dataclass(frozen=True)
class ApiGemms:
    """``BackwardGemms`` as direct API calls (the eager route). ``dgrad_weight`` is the
    weight operand of dgrad: the parameters, or a copy quantized ahead of time."""

    m_splits: Splits
    recipe: Recipe
    dgrad_weight: Weights | MXTensor
    bias_dtype: torch.dtype | None = None

    def dgrad(self, dy: torch.Tensor) -> torch.Tensor:
        return api.grouped_gemm_dgrad(dy, self.dgrad_weight, self.m_splits, recipe=self.recipe)

    def wgrad(self, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return api.grouped_gemm_wgrad(dy, x, self.m_splits, recipe=self.recipe)

    def wgrad_accumulate(self, dy: torch.Tensor, x: torch.Tensor, bufs: Sequence[torch.Tensor]) -> None:
        accumulate_wgrad(dy, x, self.m_splits, self.recipe, bufs)

    def bias_grad(self, dy: torch.Tensor) -> torch.Tensor:
        return bias_grad(dy, self.m_splits, self.bias_dtype)


def linear_backward(
    gemms: BackwardGemms,
    dy: torch.Tensor,
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    *,
    need_x: bool,
    need_w: bool,
    need_bias: bool,
    main_grad: Sequence[torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, list[torch.Tensor | None], torch.Tensor | None]:
    """The backward of ``forward_gemm``: ``(dx, dws, dbias)``, each only when needed.

    ``dws`` has one entry per tensor of ``weights``. With ``main_grad`` buffers (fused
    wgrad accumulation) the weight gradient is added into them and ``dws`` is all None:
    the caller decides what ``.grad`` receives.
    """
    dy = dy.contiguous()
    dx = gemms.dgrad(dy) if need_x else None
    dws: list[torch.Tensor | None] = [None] * len(weights)
    if need_w and main_grad is not None:
        gemms.wgrad_accumulate(dy, x, main_grad)
    elif need_w:
        dws = list(weight_grads(gemms.wgrad(dy, x), weights))
    dbias = gemms.bias_grad(dy) if need_bias else None
    return dx, dws, dbias
