"""Megatron-LM's ``main_grad`` convention for fused weight-gradient accumulation.

With ``fuse_wgrad_accumulation`` each weight carries a ``main_grad`` buffer (fp32 in
Megatron) that wgrad adds into, instead of returning a gradient; the weight's ``.grad``
then receives a placeholder (``fused_grad_placeholder``) so Megatron's hooks know the
gradient is already in ``main_grad``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from grouped_gemm import api
from grouped_gemm.errors import DTypeError, InvalidArgumentError
from grouped_gemm.recipes import Recipe
from grouped_gemm.validation import Region, first_overlap, refuse_nested

_placeholders: dict[tuple, torch.Tensor] = {}
_BUF_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


def check_no_aliasing(weights: Sequence[torch.Tensor], bufs: Sequence[torch.Tensor]) -> None:
    """InvalidArgumentError naming the ``main_grad`` that overlaps a weight (wgrad would add
    into the weight) or another ``main_grad`` (two experts' gradients would add into one);
    weights may overlap each other."""
    names = ["weight"] if len(weights) == 1 else [f"weight{i}" for i in range(len(weights))]
    buf_names = [f"{name}.main_grad" for name in names]
    if len(bufs) != len(weights):  # the fwd op also takes G buffers for one stacked weight
        buf_names = [f"main_grad[{i}]" for i in range(len(bufs))]
    regions = [Region(name, w, False) for name, w in zip(names, weights, strict=True)]
    regions += [Region(name, buf, True) for name, buf in zip(buf_names, bufs, strict=True)]
    found = first_overlap(regions)
    if found is not None:
        buf, other = found
        raise InvalidArgumentError(
            buf.name,
            buf.tensor,
            f"a buffer that shares no memory with the weights or other main_grads; it overlaps {other.name}",
        )


def main_grads(weights: Sequence[torch.Tensor], trained: Sequence[bool] | None = None) -> list[torch.Tensor]:
    """Each weight's ``main_grad`` buffer, checked (fused wgrad accumulation adds into them).

    A weight that does not train (``trained[i]`` False: a frozen expert of a
    ``separate_weights`` layer, which Megatron gives no buffer) gets a zeroed scratch buffer
    instead, so one wgrad call still serves every group and its result goes nowhere."""
    found = []
    frozen = []
    first_name = ""
    for i, w in enumerate(weights):
        if trained is not None and not trained[i]:
            frozen.append(i)
            continue
        name = "weight.main_grad" if len(weights) == 1 else f"weight{i}.main_grad"
        buf = getattr(w, "main_grad", None)
        if not isinstance(buf, torch.Tensor):
            raise InvalidArgumentError(
                name, buf, "a tensor of the weight's shape (fuse_wgrad_accumulation adds wgrad into it)"
            )
        refuse_nested(name, buf, str(tuple(w.shape)))
        if buf.shape != w.shape or buf.device != w.device:
            raise InvalidArgumentError(name, buf, f"shape {tuple(w.shape)} on {w.device}, like the weight")
        # Checked here, at forward, so a bad buffer is named as itself and not as wgrad's
        # ``out`` after the forward already ran.
        if buf.layout != torch.strided or not buf.is_contiguous():
            raise InvalidArgumentError(name, buf, "a dense contiguous tensor (wgrad adds into it in place)")
        # Backward runs outside inference mode, where torch refuses to write an inference
        # tensor (Dynamo cannot trace the test: compiled, backward's wgrad names it as out).
        if not torch.compiler.is_compiling() and buf.is_inference():
            raise InvalidArgumentError(
                name, buf, "a tensor made outside torch.inference_mode() (backward adds wgrad into it in place)"
            )
        if buf.dtype not in _BUF_DTYPES:
            raise DTypeError(name, buf, "dtype float32, bfloat16 or float16 (float32 as in Megatron-LM)")
        if found and buf.dtype != found[0].dtype:  # one wgrad call writes every buffer
            raise DTypeError(name, buf, f"dtype {found[0].dtype}, like {first_name} (one dtype for all)")
        first_name = first_name if found else name
        found.append(buf)
    dtype = found[0].dtype if found else torch.float32
    for i in frozen:
        found.insert(i, torch.zeros(weights[i].shape, dtype=dtype, device=weights[i].device))
    # Dynamo cannot trace storage pointers: under torch.compile the fwd op checks at run time.
    if not torch.compiler.is_compiling():
        check_no_aliasing(weights, found)  # (a fresh scratch buffer overlaps nothing)
    return found


def accumulate_wgrad(
    dy: torch.Tensor, x: torch.Tensor, m_splits: Any, recipe: Recipe, bufs: Sequence[torch.Tensor]
) -> None:
    """``main_grad[g] += dy[rows of g].T @ x[rows of g]``: one dispatched wgrad into the
    buffers, the stacked ``(G, N, K)`` one or G ``(N, K)`` ones."""
    target = bufs[0] if len(bufs) == 1 and bufs[0].dim() == 3 else list(bufs)
    api.grouped_gemm_wgrad(dy, x, m_splits, recipe=recipe, out=target, accumulate=True)
