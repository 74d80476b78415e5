"""Device-side tile schedule of the persistent grouped kernels.

Each program derives the whole schedule from the group sizes on the device (no host sync,
so calls with device ``m_splits`` can be captured in a CUDA graph, and no separate prefix
-sum launch): per group its first row, row count and tile count, and the running tile
total. A group's rows are cut into ``BM``-row tiles; a kernel with a second, smaller height
runs a tile with at most that many of its group's rows left (a small group's only tile, or
a larger group's last) at that height, so a skewed split's ragged tails cost a small tile
instead of a full one. Tiles are numbered group by group;
inside a group, output-column tiles are the outer index and row tiles the inner one, so
programs running at the same time (consecutive tile numbers) share one weight slab
through L2. Empty groups own no tiles and are never visited; their rows do not exist, so
nothing is left unwritten.
"""

from __future__ import annotations

import triton
import triton.language as tl

from grouped_gemm.triton_launcher import next_power_of_2


@triton.jit
def group_table(splits_ptr, num_groups, BM: tl.constexpr, col_tiles, MAX_G: tl.constexpr):
    """(group ids, first rows, row counts, tiles per group, inclusive tile ends) as
    ``MAX_G``-long vectors from the (G,) group sizes (entries past ``num_groups`` are
    empty groups); each group's rows are cut into ``BM``-row tiles."""
    gi = tl.arange(0, MAX_G)
    rows = tl.load(splits_ptr + gi, mask=gi < num_groups, other=0).to(tl.int32)
    starts = tl.cumsum(rows, 0) - rows
    tiles = tl.cdiv(rows, BM) * col_tiles
    return gi, starts, rows, tiles, tl.cumsum(tiles, 0)


@triton.jit
def locate_first(t, gi, starts, rows, tiles, tile_end, BM: tl.constexpr):
    """(group, its first row, its rows, the tile's first row within the group, its
    output-column tile) of global tile ``t``; row tiles are the inner index in a group."""
    g = tl.sum((tile_end <= t).to(tl.int32), 0)
    mine = gi == g
    local = t - tl.sum(tl.where(mine, tile_end - tiles, 0), 0)
    start = tl.sum(tl.where(mine, starts, 0), 0)
    count = tl.sum(tl.where(mine, rows, 0), 0)
    row_tiles = tl.cdiv(count, BM)
    return g, start, count, (local % row_tiles) * BM, local // row_tiles


@triton.jit
def locate(t, gi, starts, rows, tiles, tile_end, BM: tl.constexpr, BN: tl.constexpr):
    """(group, first row, rows, row offsets ``rm`` within the group, output columns ``rn``)
    of global tile ``t``."""
    g, start, count, row0, col = locate_first(t, gi, starts, rows, tiles, tile_end, BM)
    return g, start, count, row0 + tl.arange(0, BM), col * BN + tl.arange(0, BN)


def max_groups_bucket(groups: int) -> int:
    """The ``MAX_G`` a launch uses: the next power of two, at least 16."""
    return max(16, next_power_of_2(groups))
