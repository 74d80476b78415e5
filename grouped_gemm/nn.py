"""GroupedLinear: G linear layers (one per expert) applied to ragged row groups in one call.

``GroupedLinear(G, K, N)(x, m_splits)`` equals splitting ``x`` by ``m_splits``, applying
G ``nn.Linear(K, N)`` and concatenating. Forward, dgrad and wgrad each go through the
dispatcher (see ``grouped_gemm.autograd``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from grouped_gemm.autograd import grouped_linear
from grouped_gemm.errors import DTypeError, InvalidArgumentError, InvalidTypeError
from grouped_gemm.linear_math import recipe_key, weight_operand
from grouped_gemm.mx import MXTensor, quantize_mx_weight
from grouped_gemm.recipes import Recipe, get_recipe, plain_recipe_for
from grouped_gemm.validation import dtype_name

_MX_DEFAULT_DTYPE = torch.bfloat16
_PARAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(name, value, "a positive integer")
    return value


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidTypeError(name, value, "True or False")
    return value


def _layer_recipe(recipe: str | Recipe | None, dtype: torch.dtype | None) -> Recipe:
    """The recipe named, else (like ``nn.Linear``) the plain recipe of ``dtype``, bf16 without one."""
    if recipe is not None:
        return get_recipe(recipe)
    if dtype is None:
        return get_recipe("bf16")
    if not isinstance(dtype, torch.dtype) or dtype not in _PARAM_DTYPES:
        raise DTypeError("dtype", dtype, "torch.bfloat16, torch.float16, torch.float32 or None")
    return plain_recipe_for(dtype_name(dtype))


def _param_dtype(recipe: Recipe, dtype: torch.dtype | None) -> torch.dtype:
    """Plain recipes fix the parameter dtype; MX recipes keep bf16/fp16/fp32 master weights."""
    if recipe.plain_dtype is not None:
        wanted = getattr(torch, recipe.plain_dtype)
        if dtype is not None and dtype != wanted:
            raise DTypeError("dtype", dtype, f"recipe {recipe.name} computes in {wanted}; pass dtype={wanted} or None")
        return wanted
    if dtype is None:
        return _MX_DEFAULT_DTYPE
    if dtype not in _PARAM_DTYPES:
        raise DTypeError("dtype", dtype, f"recipe {recipe.name} keeps bfloat16, float16 or float32 weights")
    return dtype


class QuantizedWeightCache:
    """MX copies of a layer's weights for an MX recipe, made once per weight version.

    The forward pass needs the weight blocked along K and dgrad along N (two different
    tensors, see ``gg.quantize_mx_weight``); each is made on first use and reused until a
    weight changes. A weight counts as changed when its autograd version counter
    (``_version``: bumped by every in-place update, e.g. ``optimizer.step()`` or
    ``copy_`` under ``no_grad``), its storage (``.data = ...``, ``.to(...)``) or its
    identity changes. Writes through ``.data`` (``w.data.copy_(...)``) bypass the version
    counter: call ``GroupedLinear.refresh_quantized_weights()`` after them.
    """

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self._entries: dict[str, tuple[tuple, MXTensor]] = {}
        self.quantizations = 0

    def get(self, weights: list[torch.Tensor], op: str) -> MXTensor:
        """The weights quantized for ``op`` (``"fwd"`` or ``"dgrad"``)."""
        key = tuple((id(w), w._version, w.data_ptr(), w.dtype, w.device) for w in weights)
        hit = self._entries.get(op)
        if hit is not None and hit[0] == key:
            return hit[1]
        with torch.no_grad():
            w = weights[0].detach() if len(weights) == 1 else [t.detach() for t in weights]
            q = quantize_mx_weight(
                w,
                self.recipe.weight_format,
                op=op,
                scale_rule=self.recipe.scale_rule,
                block_size=self.recipe.block_size,
            )
        self._entries[op] = (key, q)
        self.quantizations += 1
        return q

    def clear(self) -> None:
        """Forget every quantized copy (the next use quantizes again)."""
        self._entries.clear()


class GroupedLinear(torch.nn.Module):
    """G experts' linear layers: ``y[rows of g] = x[rows of g] @ weight[g].T + bias[g]``.

    Parameters are ``weight`` ``(G, out_features, in_features)`` and ``bias``
    ``(G, out_features)``; with ``separate_weights=True`` they are G parameters
    ``weight0 ... weight{G-1}`` ``(out_features, in_features)`` and ``bias0 ...``, the
    layout checkpoints that store experts one by one use (TransformerEngine's names).
    Each expert is initialised like ``nn.Linear``: uniform in ``±1/sqrt(in_features)``.

    ``recipe`` fixes the number formats (``"bf16"``, ``"fp16"``, ``"fp32"``, or an MX
    recipe, for which ``dtype`` is the master weights' dtype, bf16 by default). Without
    one, the layer computes in ``dtype`` like ``nn.Linear`` (the plain recipe of that
    dtype; bf16 when neither is given).
    ``fuse_wgrad_accumulation``: backward adds the weight gradient into each weight's
    ``main_grad`` (which the caller allocates, as Megatron-LM's DDP does) instead of
    returning it; ``.grad`` then receives Megatron's placeholder or None (see
    ``grouped_gemm.linear_math.fused_grad_placeholder``).

    With an MX recipe the weights are quantized once per weight version and the quantized
    copies reused across forwards (``QuantizedWeightCache``) when their contraction
    dimension is a whole number of MX blocks; otherwise the backend quantizes per call.
    Under ``torch.compile`` the compiled op quantizes per call.
    """

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        recipe: str | Recipe | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        separate_weights: bool = False,
        fuse_wgrad_accumulation: bool = False,
    ) -> None:
        super().__init__()
        self.num_groups = _positive("num_groups", num_groups)
        self.in_features = _positive("in_features", in_features)
        self.out_features = _positive("out_features", out_features)
        self._recipe = _layer_recipe(recipe, dtype)
        self._recipe_key = recipe_key(self._recipe)
        self.separate_weights = _flag("separate_weights", separate_weights)
        self.fuse_wgrad_accumulation = _flag("fuse_wgrad_accumulation", fuse_wgrad_accumulation)
        self.use_bias = _flag("bias", bias)
        factory = {"dtype": _param_dtype(self._recipe, dtype), "device": device}
        g, n, k = num_groups, out_features, in_features
        if separate_weights:
            for i in range(g):
                self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.empty(n, k, **factory)))
                if bias:
                    self.register_parameter(f"bias{i}", torch.nn.Parameter(torch.empty(n, **factory)))
        else:
            self.weight = torch.nn.Parameter(torch.empty(g, n, k, **factory))
            bias_param = torch.nn.Parameter(torch.empty(g, n, **factory)) if bias else None
            self.register_parameter("bias", bias_param)
        self.reset_parameters()
        self._quantized = QuantizedWeightCache(self._recipe) if self._recipe.is_mx else None

    @property
    def recipe(self) -> Recipe:
        """The layer's recipe (fixed at construction: parameters were made for it)."""
        return self._recipe

    @property
    def weights(self) -> list[torch.nn.Parameter]:
        """The weight parameters: ``[weight]`` or ``[weight0, ..., weight{G-1}]``."""
        if self.separate_weights:
            return [getattr(self, f"weight{i}") for i in range(self.num_groups)]
        return [self.weight]

    @property
    def biases(self) -> list[torch.nn.Parameter]:
        """The bias parameters (empty without bias)."""
        if not self.use_bias:
            return []
        if self.separate_weights:
            return [getattr(self, f"bias{i}") for i in range(self.num_groups)]
        return [self.bias]

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default init for every expert: uniform in ``±1/sqrt(in_features)``."""
        bound = 1.0 / math.sqrt(self.in_features)
        with torch.no_grad():
            for p in self.weights + self.biases:
                p.uniform_(-bound, bound)

    def refresh_quantized_weights(self) -> None:
        """Drop the cached MX weights; call after writing weights through ``.data``."""
        if self._quantized is not None:
            self._quantized.clear()

    def _weight_for(self) -> Callable[[str], Any] | None:
        """The cached-quantized-weight provider for the eager route, when it applies."""
        cache = self._quantized
        if cache is None:
            return None
        block = self._recipe.block_size
        whole = {"fwd": self.in_features % block == 0, "dgrad": self.out_features % block == 0}
        weights = self.weights

        def weight_for(op: str) -> Any:
            return cache.get(weights, op) if whole[op] else weight_operand(weights)

        return weight_for

    def forward(self, x: torch.Tensor, m_splits: Any, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``(M, in_features)``, rows grouped by ``m_splits`` (G ints or a 1-D integer
        tensor, on the host or the device) -> ``(M, out_features)``, written into ``out``
        when given."""
        bias = None
        if self.use_bias:
            bias = self.bias if not self.separate_weights else torch.stack(self.biases)
        weight = self.weights if self.separate_weights else self.weight
        return grouped_linear(
            x,
            weight,
            m_splits,
            bias,
            recipe=self._recipe_key,
            out=out,
            fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
            weight_for=None if torch.compiler.is_compiling() else self._weight_for(),
        )

    def extra_repr(self) -> str:
        dtype = dtype_name(self.weights[0].dtype)
        extra = ", separate_weights=True" if self.separate_weights else ""
        extra += ", fuse_wgrad_accumulation=True" if self.fuse_wgrad_accumulation else ""
        return (
            f"num_groups={self.num_groups}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.use_bias}, recipe={self.recipe.name}, dtype={dtype}{extra}"
        )
