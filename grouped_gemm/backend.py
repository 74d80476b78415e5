"""``gmm``: the Megatron-style ``grouped_gemm`` package's low-level entry, ``grouped_gemm.backend.gmm``.

That package's users call it directly, also as ``grouped_gemm.ops.backend.gmm``: inside
their own ``autograd.Function`` s (MegaBlocks' grouped MLPs), for the forward with
``trans_b``, the weight gradient with ``trans_a=True`` and the input gradient written into
a reused buffer with ``c=``. Since both distributions share the import name, this module
gives those calls the same meaning, routed through this library's dispatcher (each
layout is one of the three ops, with no copy of an operand):

- ``trans_b=True``: ``c_g = a_g @ b_g.T``, ``b`` ``(G, N, K)`` -> ``fwd(x=a, w=b)``.
- ``trans_b=False``: ``c_g = a_g @ b_g``, ``b`` ``(G, K, N)`` -> ``dgrad(dy=a, w=b)``, which
  reads ``b`` as its ``(G, N', K')`` weight.
- ``trans_a=True``: ``c[g] = a_g.T @ b_g`` -> ``wgrad(dy=a, x=b)``; groups without rows give
  zeros.

Like the original (a C++ extension writing into ``c``), it records no autograd graph: it
runs under ``torch.no_grad()``, so ``c`` may be a buffer that requires grad, as in
MegaBlocks' backward passes. ``ops.gmm`` is the differentiable entry.

The argument checks here are shared with ``ops.gmm`` so both name the arguments their
callers wrote (``a``, ``b``, ``c``, ``batch_sizes``, ``trans_a``, ``trans_b``).
"""

from __future__ import annotations

from typing import Any

import torch

from grouped_gemm import api
from grouped_gemm.errors import (
    DeviceMismatchError,
    DTypeError,
    InvalidArgumentError,
    InvalidTypeError,
    ShapeError,
    SplitsError,
)
from grouped_gemm.group_offsets import GroupOffsets, as_ints
from grouped_gemm.validation import META_REFUSAL, Region, check_tensor, check_writable, first_overlap

__all__ = ["gmm"]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INT_DTYPES = (torch.int32, torch.int64)
_BATCH_SIZES = "a 1-D int64 tensor on the CPU or on a's device (int32 and a list of ints also work)"

#: Names the NVIDIA fork of that package (fanshiqing/grouped_gemm) adds besides the GEMM:
#: token permutation and Sinkhorn kernels, which this library does not provide.
PERMUTE_NAMES = {
    "backend": ("permute", "unpermute", "unpermute_bwd", "sinkhorn"),
    "ops": ("permute", "unpermute", "sinkhorn_kernel", "PermuteMoE_topK", "UnpermuteMoE_topK"),
}


def not_provided(module: str, name: str) -> AttributeError:
    """The AttributeError for a name of that package this one lacks: it says what the name was,
    so a port finds out at the first call rather than from a bare ``has no attribute``."""
    if name in PERMUTE_NAMES[module]:
        return AttributeError(
            f"grouped_gemm.{module}.{name} is the NVIDIA grouped_gemm fork's token permutation / Sinkhorn "
            "kernel; this package (moe-grouped-gemm) provides the grouped GEMMs only (docs/module.md, "
            "'Compatibility with the Megatron-style grouped_gemm package')"
        )
    return AttributeError(f"module 'grouped_gemm.{module}' has no attribute '{name}'")


def __getattr__(name: str) -> Any:
    raise not_provided("backend", name)


def check_flag(value: Any, argument: str) -> None:
    """``trans_a`` / ``trans_b`` must be real bools: ``1`` or ``"False"`` would pass a truth test."""
    if not isinstance(value, bool):
        raise InvalidTypeError(argument, value, "True or False")


def check_matrix(value: Any, argument: str, ndim: int, dims: str) -> torch.Tensor:
    """A dense tensor of ``ndim`` dimensions in a dtype the plain recipes take."""
    if not isinstance(value, torch.Tensor):
        raise InvalidTypeError(argument, value, f"a torch.Tensor of shape {dims}")
    if value.layout != torch.strided:
        raise InvalidTypeError(argument, value, f"a dense (strided) tensor, got layout {value.layout}")
    check_tensor(value, argument, ndim, dims)
    if value.dtype not in _FLOAT_DTYPES:
        raise DTypeError(argument, value, f"dtype bfloat16, float16 or float32, got {value.dtype}")
    return value


def _like_a(a: torch.Tensor, t: torch.Tensor, argument: str) -> None:
    if t.dtype != a.dtype:
        raise DTypeError(argument, t, f"dtype {a.dtype}, like a")
    if t.device != a.device:
        if a.device.type == "meta":  # a, without data, is at fault, not the operand that has it
            raise DeviceMismatchError("a", a, f"a tensor on {t.device}, like {argument}")
        raise DeviceMismatchError(argument, t, f"a tensor on {a.device}, like a")


def check_grouped_operands(a: Any, b: Any, trans_b: bool) -> None:
    """``a`` ``(M, K)`` and ``b`` ``(G, K, N)``, or ``(G, N, K)`` with ``trans_b``."""
    check_matrix(a, "a", 2, "(M, K)")
    dims = "(G, N, K)" if trans_b else "(G, K, N)"
    check_matrix(b, "b", 3, dims)
    if b.shape[0] < 1:
        raise ShapeError("b", b, f"at least one group: {dims} with G >= 1")
    k = b.shape[2] if trans_b else b.shape[1]
    if a.shape[1] != k:
        raise ShapeError("b", b, f"shape {dims} with K={a.shape[1]} (a's columns), trans_b={trans_b}")
    _like_a(a, b, "b")


def check_batch_sizes(
    batch_sizes: Any, groups: int | None, rows: int, device: torch.device, *, read_host: bool = True
) -> list[int] | torch.Tensor:
    """Validated group sizes: a list of ints for host sizes, the tensor itself for device ones.

    ``groups`` is None where ``batch_sizes`` alone says how many groups there are
    (``trans_a=True``). With ``read_host=False`` (under ``torch.compile``, where reading a
    tensor breaks the graph) a CPU tensor is returned unread and the op checks it when it
    runs. Sums are taken over Python ints, so int64 overflow cannot fake a valid total.
    A ``gg.offsets`` result counts as its ``splits`` tensor.
    """
    if type(batch_sizes) is GroupOffsets:
        batch_sizes = batch_sizes.splits
    if isinstance(batch_sizes, torch.Tensor):
        if batch_sizes.layout != torch.strided or batch_sizes.dim() != 1 or batch_sizes.dtype not in _INT_DTYPES:
            raise SplitsError("batch_sizes", batch_sizes, _BATCH_SIZES)
        _check_count(batch_sizes, batch_sizes.numel(), groups)
        if batch_sizes.device.type != "cpu":
            if batch_sizes.device != device:
                raise DeviceMismatchError("batch_sizes", batch_sizes, f"on the CPU or on a's device {device}")
            return batch_sizes
        if not read_host:
            return batch_sizes
        return _check_sizes(batch_sizes.tolist(), rows)
    if isinstance(batch_sizes, (list, tuple)):
        _check_count(batch_sizes, len(batch_sizes), groups)
        if not read_host:
            return list(batch_sizes)
        return _check_sizes(as_ints(batch_sizes, "batch_sizes"), rows)
    raise InvalidTypeError("batch_sizes", batch_sizes, _BATCH_SIZES)


def _check_count(batch_sizes: Any, count: int, groups: int | None) -> None:
    if groups is None:
        if count < 1:
            raise SplitsError("batch_sizes", batch_sizes, "at least one group")
    elif count != groups:
        raise SplitsError("batch_sizes", batch_sizes, f"one entry per group of b: expected {groups}, got {count}")


def _check_sizes(sizes: list[int], rows: int) -> list[int]:
    lowest = min(sizes)
    if lowest < 0:
        raise SplitsError(
            "batch_sizes", sizes, f"non-negative group sizes; batch_sizes[{sizes.index(lowest)}]={lowest}"
        )
    total = sum(sizes)
    if total != rows:
        raise SplitsError("batch_sizes", sizes, f"group sizes summing to a.shape[0]={rows}, but they sum to {total}")
    return sizes


def _check_c(c: Any, shape: tuple[int, ...], dims: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``c`` is written in place, so it must be exactly the result's tensor and share no memory
    with the operands (a kernel would read values it has already overwritten)."""
    check_matrix(c, "c", len(shape), dims)
    if tuple(c.shape) != shape:
        raise ShapeError("c", c, f"shape {dims}={shape}")
    _like_a(a, c, "c")
    if not c.is_contiguous():
        raise InvalidArgumentError("c", c, "a contiguous tensor (it is written in place)")
    check_writable("c", c)
    for name, operand in (("a", a), ("b", b)):
        if first_overlap([Region("c", c, True), Region(name, operand, False)]) is not None:
            raise InvalidArgumentError(
                "c", c, f"memory that does not overlap {name} (c is written while {name} is read)"
            )
    return c


def gmm(
    a: torch.Tensor,
    b: torch.Tensor,
    batch_sizes: torch.Tensor | list[int],
    trans_a: bool = False,
    trans_b: bool = False,
    c: torch.Tensor | None = None,
) -> torch.Tensor:
    """One grouped GEMM over the row groups of ``a``; returns ``c`` (allocated when None).

    ``trans_a=False``: ``a`` ``(M, K)``, ``b`` ``(G, K, N)`` (``(G, N, K)`` with ``trans_b``),
    result ``(M, N)``. ``trans_a=True``: ``a`` ``(M, K_a)``, ``b`` ``(M, N_b)``, result
    ``(G, K_a, N_b)`` with ``c[g] = a_g.T @ b_g`` (zeros for groups without rows).
    ``batch_sizes`` holds the G row counts: an int64 tensor on the CPU or on ``a``'s device.
    """
    check_flag(trans_a, "trans_a")
    check_flag(trans_b, "trans_b")
    if trans_a:
        if trans_b:
            raise InvalidArgumentError("trans_b", trans_b, "False when trans_a=True (b is (M, N), read untransposed)")
        check_matrix(a, "a", 2, "(M, K)")
        check_matrix(b, "b", 2, "(M, N)")
        if b.shape[0] != a.shape[0]:
            raise ShapeError("b", b, f"(M, N) with M={a.shape[0]} rows like a (trans_a=True)")
        _like_a(a, b, "b")
        sizes = check_batch_sizes(batch_sizes, None, a.shape[0], a.device)
        shape, dims = (len(sizes), a.shape[1], b.shape[1]), "(G, K, N)"
    else:
        check_grouped_operands(a, b, trans_b)
        sizes = check_batch_sizes(batch_sizes, b.shape[0], a.shape[0], a.device)
        shape, dims = (a.shape[0], b.shape[1] if trans_b else b.shape[2]), "(M, N)"
    if c is not None:
        _check_c(c, shape, dims, a, b)
    if a.device.type == "meta":  # (b and c are on a's device) else refused as the op's dy or x
        raise DeviceMismatchError("a", a, META_REFUSAL)
    with torch.no_grad():
        if trans_a:
            result = api.grouped_gemm_wgrad(a, b, sizes, out=c)
        elif trans_b:
            result = api.grouped_gemm(a, b, sizes, out=c)
        else:
            result = api.grouped_gemm_dgrad(a, b, sizes, out=c)
    return result if c is None else c
