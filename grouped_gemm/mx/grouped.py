"""Grouped helpers: what MoE backends quantize, with the block axis each op needs.

- Weights ``(G, N, K)``: along K for the forward pass, and separately along N for dgrad
  (``dx_g = dy_g @ w_g`` contracts over N). The two are different tensors: neither is
  the other's transpose.
- Token rows of G groups (``x`` or ``dy`` of wgrad, which contracts over M): along M, per
  group, each group padded with zero rows to a multiple of ``align`` so that no block
  straddles two groups. The padded group starts (``padded_offsets``) are kept apart from
  the tight ones (``offsets``): kernels read the quantized operand at the first and the
  original rows at the second.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Literal

import torch

from grouped_gemm.errors import DeviceMismatchError, InvalidArgumentError, InvalidTypeError, ShapeError, SplitsError
from grouped_gemm.group_ends import padded_row_table
from grouped_gemm.group_offsets import (
    MAX_ROWS,
    GroupOffsets,
    check_split_tensor,
    host_split_ints,
    host_to_device,
    visible_device,
)
from grouped_gemm.mx import torch_quantizer
from grouped_gemm.mx.formats import BLOCK_SIZE, FORMATS
from grouped_gemm.mx.quantize import as_block_size, check_args, quantize_checked, scale_rule_name
from grouped_gemm.mx.tensor import MXTensor

_WEIGHT_AXIS = {"fwd": 2, "dgrad": 1}


def quantize_mx_weight(
    w: torch.Tensor | list[torch.Tensor],
    fmt: str,
    *,
    op: Literal["fwd", "dgrad"] = "fwd",
    scale_rule: str = "rceil",
    block_size: int = BLOCK_SIZE,
    pad: bool = False,
) -> MXTensor:
    """Quantize a ``(G, N, K)`` weight (or a list of G ``(N, K)`` tensors, stacked) for ``op``:
    along K (axis 2) for ``"fwd"``, along N (axis 1) for ``"dgrad"``."""
    if not isinstance(op, str) or op not in _WEIGHT_AXIS:
        raise InvalidArgumentError("op", op, "'fwd' (blocks along K) or 'dgrad' (blocks along N)")
    if isinstance(w, (list, tuple)):
        if not w or not all(isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_nested for t in w):
            raise InvalidTypeError("w", w, "a (G, N, K) tensor or a non-empty list of G (N, K) tensors")
        for i, t in enumerate(w[1:], 1):  # torch.stack would fail (or move nothing) unnamed
            if t.shape != w[0].shape:
                raise ShapeError(f"w[{i}]", t, f"shape {tuple(w[0].shape)}, like w[0]")
            if t.device != w[0].device:
                raise DeviceMismatchError(f"w[{i}]", t, f"a tensor on {w[0].device}, like w[0]")
        w = torch.stack(list(w))
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        raise ShapeError("w", w, "a (G, N, K) tensor or a non-empty list of G (N, K) tensors")
    f, axis, missing = check_args(w, fmt, _WEIGHT_AXIS[op], scale_rule, block_size, pad, argument="w")
    return quantize_checked(w, f, axis, scale_rule_name(scale_rule), as_block_size(block_size), missing)


@dataclasses.dataclass(frozen=True, eq=False)
class MXRows:
    """Token rows of G groups quantized along M, each group zero-padded to ``align`` rows.

    ``tensor`` is an ``(R, C)`` MXTensor along axis 0; group g owns its rows
    ``[padded_offsets[g], padded_offsets[g + 1])``, of which the first ``m_splits[g]`` are
    the group's rows ``[offsets[g], offsets[g + 1])`` of the input and the rest zeros.
    ``offsets`` / ``padded_offsets`` are ``(G + 1,)`` int32 tensors on the data's device.
    With host splits ``R == padded_offsets[-1]`` and ``padded_splits`` is a list; with
    splits on the device nothing is synchronized: ``R`` is the bound
    ``M + G * (align - 1)`` rounded up to ``align`` (the tail is zero rows) and
    ``padded_splits`` is a device tensor.
    """

    tensor: MXTensor
    m_splits: list[int] | torch.Tensor
    padded_splits: list[int] | torch.Tensor
    offsets: torch.Tensor
    padded_offsets: torch.Tensor
    align: int

    @property
    def groups(self) -> int:
        return self.offsets.numel() - 1

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tight ``(M, C)`` rows again (padding rows dropped)."""
        full = self.tensor.dequantize(dtype)
        return full[_row_map(self, full.device) >= 0]


def _row_map(rows: MXRows, device: torch.device) -> torch.Tensor:
    sizes = torch.diff(rows.offsets.to(device, torch.int64))
    return _build_row_map(sizes, rows.tensor.shape[0], rows.align)


def _build_row_map(sizes: torch.Tensor, total: int, align: int) -> torch.Tensor:
    """The row map of the padded layout (the CPU path and ``MXRows.dequantize``): padded row
    p reads input row ``row_map[p]`` (-1: a zero row). On ``sizes.device``, no host sync."""
    padded = (sizes + align - 1) // align * align
    pend = torch.cumsum(padded, 0)
    tend = torch.cumsum(sizes, 0)
    pstart = pend - padded
    tstart = tend - sizes
    p = torch.arange(total, device=sizes.device)
    g = torch.searchsorted(pend, p, right=True)
    gc = g.clamp(max=sizes.numel() - 1)
    local = p - pstart[gc]
    valid = (g < sizes.numel()) & (local < sizes[gc])
    return torch.where(valid, tstart[gc] + local, -1).to(torch.int32)


def _sizes(m_splits: Any, rows: int, device: torch.device) -> tuple[list[int] | None, torch.Tensor]:
    """(host list and its int64 CPU tensor, or None and the sizes moved to ``device``) for
    validated-enough splits (a ``gg.offsets`` result counts as its ``splits`` tensor)."""
    if type(m_splits) is GroupOffsets:
        if m_splits.written():  # as every GEMM call refuses them
            raise SplitsError(
                "m_splits", m_splits, "gg.offsets(...) as built: its splits or ends were written in place since"
            )
        m_splits = m_splits.splits
    if isinstance(m_splits, torch.Tensor) and m_splits.device.type not in ("cpu", "meta"):
        check_split_tensor(m_splits, "m_splits")
        return None, m_splits.to(device)
    if isinstance(m_splits, torch.Tensor) and m_splits.device.type == "meta":
        raise SplitsError("m_splits", m_splits, "a tensor with data (on the CPU or t's device), not meta")
    m_splits = host_split_ints(m_splits)
    if not m_splits or min(m_splits) < 0 or sum(m_splits) != rows:
        raise SplitsError("m_splits", m_splits, f"at least one non-negative group size, summing to t.shape[0]={rows}")
    host = list(m_splits)
    return host, torch.tensor(host, dtype=torch.int64, device="cpu")


def _check_align(align: Any, block_size: int) -> None:
    if isinstance(align, bool) or not isinstance(align, int) or align < block_size or align % block_size:
        raise InvalidArgumentError("align", align, f"a positive multiple of block_size={block_size}")


def _row_layout(
    host: list[int] | None, sizes: torch.Tensor, rows: int, align: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, list[int] | torch.Tensor, int]:
    """(offsets, padded offsets, padded sizes, padded rows) of ``rows`` token rows in groups
    of ``sizes`` padded to ``align``; the offsets (G + 1,) int32 on ``device``.
    Host sizes: the padded sizes as a list, the rows exact, the offsets in one pinned copy.
    Device sizes: one launch (``padded_row_table``), and the rows the bound
    ``rows + G * (align - 1)`` rounded up to ``align`` (no sync; its tail is zero rows).
    The offsets are int32: a layout past that (a huge ``align``) is named as ``align`` here,
    not torch's "cannot be converted to type int32" (or a gather of that many rows)."""
    groups = sizes.numel()
    if host is None:
        padded, padded_rows = None, -(-(rows + groups * (align - 1)) // align) * align
    else:
        padded = [-(-s // align) * align for s in host]
        padded_rows = sum(padded)
    if padded_rows > MAX_ROWS:
        raise InvalidArgumentError(
            "align",
            align,
            f"a multiple of the block size small enough for int32 offsets: {groups} groups of {rows} rows "
            f"padded to it exceed {MAX_ROWS} rows",
        )
    if padded is None:
        offsets, padded_offsets, padded_sizes = padded_row_table(sizes, align)
        return offsets, padded_offsets, padded_sizes, padded_rows
    table = host_to_device([0, *itertools.accumulate(host), 0, *itertools.accumulate(padded)], device)
    return table[: len(host) + 1], table[len(host) + 1 :], padded, padded_rows


def padded_row_offsets(
    m_splits: list[int] | torch.Tensor | GroupOffsets, rows: int, device: torch.device | str, align: int = BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(offsets, padded offsets, padded rows) of ``quantize_mx_rows``'s layout without
    quantizing: (G + 1,) int32 group starts of the ``rows`` token rows and of their groups
    padded to multiples of ``align``, on ``device`` (a CUDA / ROCm GPU: one launch for
    device splits, one copy for host ones), and the padded layout's row count. For kernels
    that quantize token rows per group themselves (the MX wgrad operands)."""
    _check_align(align, BLOCK_SIZE)
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise InvalidArgumentError("rows", rows, "a non-negative int (the token rows the splits cover)")
    device = visible_device(device)  # an absent GPU failed in torch's pinned-memory copy
    host, sizes = _sizes(m_splits, rows, device)
    offsets, padded_offsets, _, padded_rows = _row_layout(host, sizes, rows, align, device)
    return offsets, padded_offsets, padded_rows


def quantize_mx_rows(
    t: torch.Tensor,
    m_splits: list[int] | torch.Tensor | GroupOffsets,
    fmt: str,
    *,
    align: int = BLOCK_SIZE,
    scale_rule: str = "rceil",
    block_size: int = BLOCK_SIZE,
) -> MXRows:
    """Quantize the rows of ``t`` ``(M, C)`` along M per group (``m_splits``), padding every
    group with zero rows to a multiple of ``align`` (a multiple of ``block_size``: 32, or
    a backend's K block for wgrad). On CUDA / ROCm the fused kernel reads the rows in
    place; on the CPU the padded rows are gathered, then quantized by torch."""
    block_size = as_block_size(block_size)
    check_args(t, fmt, 0, scale_rule, block_size, True)
    scale_rule = scale_rule_name(scale_rule)
    if t.dim() != 2:
        raise ShapeError("t", t, "a 2-D (M, C) tensor of token rows")
    _check_align(align, block_size)
    t = t.resolve_neg()  # as quantize_checked: the Triton kernel reads memory without the sign bit
    host, sizes = _sizes(m_splits, t.shape[0], t.device)
    offsets, padded_offsets, padded_splits, total = _row_layout(host, sizes, t.shape[0], align, t.device)
    if t.device.type == "cuda":  # CUDA and ROCm: the fused kernel finds each row's group itself
        from grouped_gemm.mx import triton_quantizer  # imports Triton only when a GPU needs it

        tensor = triton_quantizer.quantize_rows(t, offsets, padded_offsets, total, FORMATS[fmt], scale_rule, block_size)
    else:
        row_map = _build_row_map(sizes, total, align)
        source = t if t.shape[0] else t.new_zeros(1, t.shape[1])
        gathered = torch.where((row_map >= 0).unsqueeze(1), source[row_map.clamp(min=0).long()], 0)
        tensor = torch_quantizer.quantize(gathered, FORMATS[fmt], 0, scale_rule, block_size, 0)
    # Host sizes as the private list: the caller's list may change after this call.
    return MXRows(tensor, host if host is not None else m_splits, padded_splits, offsets, padded_offsets, align)
