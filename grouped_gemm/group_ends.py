"""Cumulative group ends of device splits in one small Triton launch.

Why: the kernels read the ends ``[m0, m0+m1, ..., M]``, not the sizes. ``torch.cumsum``
into int32 launches two cub kernels (after a dtype copy for int64 sizes) and, on the H200
host, cost about as much host time as the grouped GEMM it feeds (cProfile, issue 14). One
program of ``group_ends_kernel`` loads up to ``MAX_GROUPS`` sizes of any split dtype, scans
them in int64 and stores the ends, and for ``gg.offsets`` the private copy of the sizes as
well. The scan wraps to the ends' dtype exactly as ``torch.cumsum(..., dtype=...)`` does.
CPU tensors and more groups take ``torch.cumsum``.

``padded_row_table`` does the same for token rows quantized per group with every group
padded to ``align`` rows (``gg.quantize_mx_rows``, the MX wgrad operands): tight starts,
padded starts and padded sizes in one launch, where torch took about a dozen small ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from grouped_gemm.triton_launcher import CachedLauncher, next_power_of_2

#: Groups one program scans in registers; more take ``torch.cumsum`` (MoE layers have at
#: most a few hundred experts per rank).
MAX_GROUPS = 1 << 14
#: The smallest block: fewer distinct compiles for small G.
_MIN_BLOCK = 16


@triton.jit
def group_ends_kernel(sizes_ptr, ends_ptr, copy_ptr, groups, COPY: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.arange(0, BLOCK)
    mask = idx < groups
    sizes = tl.load(sizes_ptr + idx, mask=mask, other=0)
    if COPY:
        tl.store(copy_ptr + idx, sizes, mask=mask)
    ends = tl.cumsum(sizes.to(tl.int64), 0)
    tl.store(ends_ptr + idx, ends.to(ends_ptr.dtype.element_ty), mask=mask)


_GROUP_ENDS = CachedLauncher(group_ends_kernel)


@triton.jit
def padded_row_table_kernel(sizes_ptr, table_ptr, groups, ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    # table: [0, tight ends (G) | 0, padded ends (G) | padded sizes (G)], int32
    idx = tl.arange(0, BLOCK)
    mask = idx < groups
    sizes = tl.load(sizes_ptr + idx, mask=mask, other=0).to(tl.int64)
    padded = (sizes + ALIGN - 1) // ALIGN * ALIGN
    first = idx == 0
    tl.store(table_ptr + idx, 0, mask=first)
    tl.store(table_ptr + 1 + idx, tl.cumsum(sizes, 0).to(tl.int32), mask=mask)
    tl.store(table_ptr + groups + 1 + idx, 0, mask=first)
    tl.store(table_ptr + groups + 2 + idx, tl.cumsum(padded, 0).to(tl.int32), mask=mask)
    tl.store(table_ptr + 2 * groups + 2 + idx, padded.to(tl.int32), mask=mask)


_PADDED_ROW_TABLE = CachedLauncher(padded_row_table_kernel)


def _kernel_runs(t: torch.Tensor) -> bool:
    """GPU tensors run the compiled kernel; CPU tensors only in Triton's interpreter."""
    if not 0 < t.shape[0] <= MAX_GROUPS or not t.is_contiguous():
        return False
    if t.device.type == "cpu":
        return isinstance(group_ends_kernel, InterpretedFunction)
    return t.device.type == "cuda"


def group_ends(sizes: torch.Tensor, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """``torch.cumsum(sizes, 0, dtype=dtype)`` in one launch (see the module docstring)."""
    if not _kernel_runs(sizes):
        return torch.cumsum(sizes, 0, dtype=dtype)
    ends = torch.empty(sizes.shape[0], dtype=dtype, device=sizes.device)
    _launch(sizes, ends, None)
    return ends


def copy_and_ends(sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a private copy of ``sizes``, their int32 ends) on ``sizes``' device, in one launch."""
    if not _kernel_runs(sizes):
        copy = sizes.clone()
        return copy, torch.cumsum(copy, 0, dtype=torch.int32)
    copy = torch.empty_like(sizes)
    ends = torch.empty(sizes.shape[0], dtype=torch.int32, device=sizes.device)
    _launch(sizes, ends, copy)
    return copy, ends


def _launch(sizes: torch.Tensor, ends: torch.Tensor, copy: torch.Tensor | None) -> None:
    groups = sizes.shape[0]
    block = max(_MIN_BLOCK, next_power_of_2(groups))
    _GROUP_ENDS(
        (1,),
        sizes,
        ends,
        ends if copy is None else copy,
        groups,
        COPY=copy is not None,
        BLOCK=block,
        num_warps=4 if block <= 4096 else 8,
    )


def padded_row_table(sizes: torch.Tensor, align: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tight starts (G + 1,), padded starts (G + 1,), padded sizes (G,)), int32 on
    ``sizes``' device, for (G,) non-negative group sizes padded to multiples of ``align``."""
    groups = sizes.shape[0]
    if not _kernel_runs(sizes):
        sizes = sizes.to(torch.int64)
        padded = (sizes + align - 1) // align * align
        zero = sizes.new_zeros(1)
        table = torch.cat([zero, torch.cumsum(sizes, 0), zero, torch.cumsum(padded, 0), padded]).to(torch.int32)
    else:
        table = torch.empty(3 * groups + 2, dtype=torch.int32, device=sizes.device)
        block = max(_MIN_BLOCK, next_power_of_2(groups))
        _PADDED_ROW_TABLE((1,), sizes, table, groups, ALIGN=align, BLOCK=block, num_warps=4 if block <= 4096 else 8)
    return table[: groups + 1], table[groups + 1 : 2 * groups + 2], table[2 * groups + 2 :]
