"""GroupedLinear: G linear layers (one per expert) applied to ragged row groups in one call.

``GroupedLinear(G, K, N)(x, m_splits)`` equals splitting ``x`` by ``m_splits``, applying
G ``nn.Linear(K, N)`` and concatenating. Forward, dgrad and wgrad each go through the
dispatcher (see ``grouped_gemm.autograd``).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import weakref
from typing import Any

import torch
from torch.nn.utils import parametrize
from torch.optim.optimizer import register_optimizer_step_post_hook

from grouped_gemm.autograd import run_grouped_linear
from grouped_gemm.errors import DeviceMismatchError, DTypeError, InvalidArgumentError, InvalidTypeError, ShapeError
from grouped_gemm.mx import MXTensor, quantize_mx_weight
from grouped_gemm.recipe_codec import recipe_from_key, recipe_key
from grouped_gemm.recipes import Recipe, get_recipe, plain_recipe_for
from grouped_gemm.updates import count_writes, write_stamp
from grouped_gemm.validation import refuse_nested
from grouped_gemm.vocabulary import dtype_name

_MX_DEFAULT_DTYPE = torch.bfloat16
_PARAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: The recipe key of each parameter dtype's plain recipe (a layer built without a recipe).
_PLAIN_KEYS = {dtype: recipe_key(plain_recipe_for(dtype_name(dtype))) for dtype in _PARAM_DTYPES}


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


@dataclasses.dataclass(frozen=True)
class FrozenWeights:
    """MX copies of a layer's weights made by ``freeze_quantized_weights``, and what the
    weights were when they were made (to refuse a forward once they changed)."""

    quantized: dict[str, MXTensor]
    stamp: tuple[tuple[int, int, tuple[int, int]], ...]
    #: The weights' tensors at freeze time (aliases, not copies). Holding their storage keeps
    #: its address from going to a replacement (``weight.data = new``, as checkpoint loaders
    #: do), which the stamp's data pointer would otherwise take for the original.
    sources: tuple[torch.Tensor, ...] = ()


def _stamp(weights: list[torch.nn.Parameter]) -> tuple[tuple[int, int, tuple[int, int]], ...]:
    """Identity, storage and in-place writes (``write_stamp``) of each weight."""
    return tuple((id(w), w.data_ptr(), write_stamp(w)) for w in weights)


#: Layers that froze quantized weights, for ``_declare_optimizer_writes``.
_frozen_layers: weakref.WeakSet[GroupedLinear] = weakref.WeakSet()
_step_hook_lock = threading.Lock()
_step_hook: Any = None


def _declare_optimizer_writes(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After any optimizer step: fused steps (``torch.optim.Adam(fused=True)``, multi-tensor
    kernels of other libraries) write the parameters without bumping their version, which
    left a frozen copy looking current. Declare the write on the frozen layers' weights that
    this optimizer holds and updated (torch.optim steps skip parameters without a grad, so
    experts frozen with ``requires_grad_(False)`` beside trained ones keep their copy); a
    cost per step only while some layer is frozen."""
    layers = [layer for layer in list(_frozen_layers) if layer._frozen is not None]
    if not layers:
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"] if p.grad is not None}
    count_writes([w for layer in layers for w in layer.weights if id(w) in held])


def _watch_optimizer_steps(layer: GroupedLinear) -> None:
    """Have every optimizer step check ``layer`` (the global hook is registered once)."""
    global _step_hook
    with _step_hook_lock:
        if _step_hook is None:
            _step_hook = register_optimizer_step_post_hook(_declare_optimizer_writes)
        _frozen_layers.add(layer)


class GroupedLinear(torch.nn.Module):
    """G experts' linear layers: ``y[rows of g] = x[rows of g] @ weight[g].T + bias[g]``.

    Parameters are ``weight`` ``(G, out_features, in_features)`` and ``bias``
    ``(G, out_features)``; with ``separate_weights=True`` they are G parameters
    ``weight0 ... weight{G-1}`` ``(out_features, in_features)`` and ``bias0 ...``, the
    layout checkpoints that store experts one by one use (TransformerEngine's names).
    Each expert is initialised like ``nn.Linear``: uniform in ``±1/sqrt(in_features)``.

    ``recipe`` fixes the number formats (``"bf16"``, ``"fp16"``, ``"fp32"``, or an MX
    recipe, for which ``dtype`` is the master weights' dtype, bf16 by default). Without
    one, the layer computes in its parameters' dtype like ``nn.Linear`` (``dtype``, bf16
    when neither is given), and keeps doing so after ``.to(dtype)``, ``.half()`` or a
    mixed-precision wrapper casts them.
    ``fuse_wgrad_accumulation``: backward adds the weight gradient into each weight's
    ``main_grad`` (which the caller allocates, as Megatron-LM's DDP does) instead of
    returning it; ``.grad`` then receives Megatron's placeholder or None (see
    ``grouped_gemm.main_grad.fused_grad_placeholder``).

    With an MX recipe every call quantizes the master weights (forward along K, dgrad along
    N from the weight saved by forward), so optimizer updates are always seen, also when a
    CUDA graph replays the step. For inference with weights that do not change,
    ``freeze_quantized_weights()`` quantizes once, explicitly.
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
        # Without a recipe the plain recipe follows the parameters' dtype (module doc).
        self._follows_dtype = recipe is None
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
        self._frozen: FrozenWeights | None = None

    @property
    def recipe(self) -> Recipe:
        """The layer's recipe: the one it was built with, or (built without one) the plain
        recipe of its parameters' dtype now (what a forward passes on)."""
        key = self._call_recipe_key(self.weights[0])
        return self._recipe if key == self._recipe_key else recipe_from_key(key)

    def _call_recipe_key(self, weight: torch.Tensor) -> str:
        """The recipe key a forward passes on (``recipe``, read from ``weight``'s dtype)."""
        if self._follows_dtype and weight.dtype in _PARAM_DTYPES:
            return _PLAIN_KEYS[weight.dtype]
        return self._recipe_key

    @property
    def _weight_names(self) -> list[str]:
        """The weight parameters' names: ``["weight"]`` or ``["weight0", ..., "weight{G-1}"]``."""
        return [f"weight{i}" for i in range(self.num_groups)] if self.separate_weights else ["weight"]

    @property
    def weights(self) -> list[torch.nn.Parameter]:
        """The weight parameters, in ``_weight_names``' order."""
        return [getattr(self, name) for name in self._weight_names]

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

    def freeze_quantized_weights(self, *, backward: bool = False) -> None:
        """Quantize the MX weights once, now, and use that copy in every later forward
        (inference with fixed weights: no per-call quantization).

        Updates are not seen until this is called again: a forward refuses to run when a
        weight changed in place or was replaced since (``_version`` / storage / identity;
        writes torch does not count, such as ``torch.distributed`` collectives, writes
        through ``.data`` or into a buffer the weights are ``.data`` views of, escape that
        check unless declared with ``gg.mark_updated`` (on the weights or the buffer); every
        ``torch.optim`` step declares its write on the frozen weights it holds, fused or not; and
        a CUDA graph replay runs no Python check at all), and refuses to run while the
        weights require grad under grad mode
        (an optimizer would make the copy stale). ``backward=True`` also quantizes dgrad's
        copy (blocks along N), for gradients to the input through frozen weights; it costs
        as much memory again. Needs whole MX blocks along ``in_features`` (and along
        ``out_features`` for ``backward``). Under ``torch.compile`` the compiled op
        quantizes the current weights per call instead (same quantizer, same numbers).
        """
        recipe = self._recipe
        if not recipe.is_mx:
            raise InvalidArgumentError("recipe", recipe.name, "an MX recipe (plain recipes have nothing to quantize)")
        _flag("backward", backward)
        parametrized = [name for name in self._weight_names if parametrize.is_parametrized(self, name)]
        if parametrized:
            # Such a weight is a new tensor at every access: no stamp can tell whether its
            # source changed, so the copy could neither be trusted nor kept.
            raise InvalidArgumentError(
                parametrized[0],
                "parametrized (torch.nn.utils.parametrize)",
                "a plain parameter to freeze a quantized copy of; remove the parametrization first "
                "(parametrize.remove_parametrizations) or run without freezing",
            )
        ops = {"fwd": ("in_features", self.in_features)}
        if backward:
            ops["dgrad"] = ("out_features", self.out_features)
        for name, size in ops.values():
            if size % recipe.block_size:
                raise InvalidArgumentError(
                    name, size, f"a multiple of the MX block size {recipe.block_size} to freeze quantized weights"
                )
        weights = self.weights
        with torch.no_grad():
            w = weights[0].detach() if not self.separate_weights else [p.detach() for p in weights]
            quantized = {
                op: quantize_mx_weight(
                    w, recipe.weight_format, op=op, scale_rule=recipe.scale_rule, block_size=recipe.block_size
                )
                for op in ops
            }
        self._frozen = FrozenWeights(quantized, _stamp(weights), tuple(p.detach() for p in weights))
        _watch_optimizer_steps(self)

    def __getstate__(self) -> dict[str, Any]:
        # A copy (deepcopy, torch.save) has new weights, which a frozen copy's stamp cannot
        # match: mark a stale one so that it stays refused, and __setstate__ re-stamps the rest.
        # The sources stay behind: the copy holds its own weights.
        state = super().__getstate__()
        frozen = self._frozen
        if frozen is not None:
            stale = _stamp(self.weights) != frozen.stamp
            state["_frozen"] = dataclasses.replace(frozen, stamp=() if stale else frozen.stamp, sources=())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        frozen = state.get("_frozen")
        if frozen is not None and frozen.stamp:
            weights = self.weights
            self._frozen = dataclasses.replace(
                frozen, stamp=_stamp(weights), sources=tuple(p.detach() for p in weights)
            )
            _watch_optimizer_steps(self)

    def unfreeze_quantized_weights(self) -> None:
        """Drop the frozen copy: forwards quantize the current weights per call again."""
        self._frozen = None

    @property
    def frozen(self) -> bool:
        """Whether ``freeze_quantized_weights`` is in force."""
        return self._frozen is not None

    def _frozen_for(self, x: torch.Tensor) -> dict[str, MXTensor] | None:
        """The frozen copies for this forward, after checking they are still valid."""
        frozen = self._frozen
        if frozen is None or torch.compiler.is_compiling():
            return None
        weights = self.weights
        if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
            raise InvalidArgumentError(
                "weight",
                "requires_grad=True with frozen quantized weights",
                "frozen weights must not train (an update would leave the quantized copy stale): "
                "call unfreeze_quantized_weights(), run under torch.no_grad(), or requires_grad_(False)",
            )
        if _stamp(weights) != frozen.stamp:
            raise InvalidArgumentError(
                "weight",
                "changed since freeze_quantized_weights()",
                "the weights the frozen copy was made from: call freeze_quantized_weights() again "
                "(or unfreeze_quantized_weights())",
            )
        if torch.is_grad_enabled() and x.requires_grad and "dgrad" not in frozen.quantized:
            raise InvalidArgumentError(
                "x",
                "requires_grad=True with frozen quantized weights",
                "an input that needs no gradient, or freeze_quantized_weights(backward=True) for dgrad's copy",
            )
        return frozen.quantized

    def _stacked_biases(self) -> torch.Tensor:
        """``bias0 ... bias{G-1}`` as one ``(G, out_features)`` tensor, each checked first
        (``torch.stack``'s own errors name no parameter)."""
        biases = self.biases
        for i, b in enumerate(biases):
            if not isinstance(b, torch.Tensor):
                raise InvalidTypeError(f"bias{i}", b, f"a tensor of shape (out_features,)=({self.out_features},)")
            refuse_nested(f"bias{i}", b, f"({self.out_features},)")
            if tuple(b.shape) != (self.out_features,):
                raise ShapeError(f"bias{i}", b, f"shape (out_features,)=({self.out_features},)")
            if b.device != biases[0].device:
                raise DeviceMismatchError(f"bias{i}", b, f"a tensor on {biases[0].device}, like bias0")
        return torch.stack(biases)

    def forward(self, x: torch.Tensor, m_splits: Any, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``(M, in_features)``, rows grouped by ``m_splits`` (G ints or a 1-D integer
        tensor, on the host or the device) -> ``(M, out_features)``, written into ``out``
        when given."""
        bias = None
        if self.use_bias:
            bias = self.bias if not self.separate_weights else self._stacked_biases()
        weight = self.weights if self.separate_weights else self.weight
        if not self.separate_weights:
            shape = (self.num_groups, self.out_features, self.in_features)
            if weight.shape != shape:
                # A parameter replaced by one of another shape: named here, not as the bias or
                # the splits that would disagree with it further down.
                raise ShapeError("weight", weight, f"(num_groups, out_features, in_features)={shape}, as built")
        frozen = self._frozen_for(x)
        key = self._call_recipe_key(weight[0] if self.separate_weights else weight)
        return run_grouped_linear(x, weight, m_splits, bias, key, out, self.fuse_wgrad_accumulation, frozen)

    def extra_repr(self) -> str:
        dtype = dtype_name(self.weights[0].dtype)
        extra = ", separate_weights=True" if self.separate_weights else ""
        extra += ", fuse_wgrad_accumulation=True" if self.fuse_wgrad_accumulation else ""
        extra += ", frozen_quantized_weights=True" if self.frozen else ""
        return (
            f"num_groups={self.num_groups}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.use_bias}, recipe={self.recipe.name}, dtype={dtype}{extra}"
        )
