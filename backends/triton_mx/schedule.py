"""Device-side tile schedule of the persistent grouped kernels.

Each program derives the whole schedule from the group sizes on the device (no host sync,
so calls with device ``m_splits`` can be captured in a CUDA graph, and no separate prefix
-sum launch): per group its first row, row count and tile count, and the running tile
total. Tiles are numbered
group by group; inside a group, output-column tiles are the outer index and row tiles the
inner one, so programs running at the same time (consecutive tile numbers) share one
weight slab through L2. Empty groups own no tiles and are never visited; their rows do
not exist, so nothing is left unwritten.
"""

from __future__ import annotations

import triton
import triton.language as tl

from grouped_gemm.triton_launcher import next_power_of_2


@triton.jit
def group_table(splits_ptr, num_groups, rows_per_tile: tl.constexpr, col_tiles, MAX_G: tl.constexpr):
    """(group ids, first rows, row counts, tiles per group, inclusive tile ends) as
    ``MAX_G``-long vectors from the (G,) group sizes (entries past ``num_groups`` are
    empty groups)."""
    gi = tl.arange(0, MAX_G)
    rows = tl.load(splits_ptr + gi, mask=gi < num_groups, other=0).to(tl.int32)
    starts = tl.cumsum(rows, 0) - rows
    tiles = tl.cdiv(rows, rows_per_tile) * col_tiles
    return gi, starts, rows, tiles, tl.cumsum(tiles, 0)


@triton.jit
def locate(t, gi, starts, rows, tiles, tile_end, BM: tl.constexpr, BN: tl.constexpr):
    """(group, first row, rows, row offsets ``rm`` within the group, output columns ``rn``)
    of global tile ``t``; row tiles are the inner index inside a group."""
    g = tl.sum((tile_end <= t).to(tl.int32), 0)
    mine = gi == g
    local = t - tl.sum(tl.where(mine, tile_end - tiles, 0), 0)
    start = tl.sum(tl.where(mine, starts, 0), 0)
    count = tl.sum(tl.where(mine, rows, 0), 0)
    row_tiles = tl.cdiv(count, BM)
    rm = (local % row_tiles) * BM + tl.arange(0, BM)
    rn = (local // row_tiles) * BN + tl.arange(0, BN)
    return g, start, count, rm, rn


def max_groups_bucket(groups: int) -> int:
    """The ``MAX_G`` a launch uses: the next power of two, at least 16."""
    return max(16, next_power_of_2(groups))
