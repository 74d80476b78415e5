"""Persistent grouped kernel on plain bf16 / fp16 operands: fwd and dgrad of ``triton_grouped``.

``out[rows of g, :] = a[rows of g, :] @ B_g`` where ``B_g`` is the (contraction, output
column) view of weight ``g``: fwd reads ``w[g]`` (N, K) transposed, dgrad reads it as it
is; only the two weight strides passed in differ. The tile schedule is the MX kernels'
(``schedule``: group sizes read on the device, empty groups own no tiles) and the loop is
their ``contraction.contract``; the step is a masked load of both tiles and one ``tl.dot``
into fp32, so any N and K give the right answer (the backend's alignment is about fast
loads, not correctness).

With ``TMA`` the same loop fetches both tiles by the copy engine (tensor descriptors, sm_90
and newer): no address arithmetic or masks in the loop, and Triton pipelines the copies
with barriers instead of ``cp.async``. A descriptor zero-fills what lies past its tensor's
edges, which covers the contraction tail and the last rows of ``a``; an activation tile
that runs past its group reads the next group's rows, which only reach accumulator rows the
masked store leaves out. The weight descriptor is 3-D (G, N, K), so a weight tile never
reaches into the next group's weight. On the H200 (2026-12-04, docs/performance.md) it ran
1.05-1.17x the pointer-load kernel at the 128 x 256 tiles.
"""

from __future__ import annotations

import triton
import triton.language as tl

from grouped_gemm.backends.triton_mx.contraction import contract
from grouped_gemm.backends.triton_mx.decode import bf16_dot, narrow
from grouped_gemm.backends.triton_mx.schedule import group_table, locate_first


@triton.jit
def _step(
    acc,
    k,
    a_rows,
    w_cols,
    stride_wc,
    m_ok,
    n_ok,
    k_red,
    BK: tl.constexpr,
    EVEN_K: tl.constexpr,
    INTERP: tl.constexpr,
):
    """Contraction elements ``k .. k + BK``: the (BM, BK) activation tile times the (BK, BN)
    weight tile, added to the fp32 ``acc``."""
    kk = k + tl.arange(0, BK)
    if EVEN_K:
        a_ok = m_ok[:, None]
        w_ok = n_ok[None, :]
    else:
        k_ok = kk < k_red
        a_ok = m_ok[:, None] & k_ok[None, :]
        w_ok = n_ok[None, :] & k_ok[:, None]
    a = tl.load(a_rows[:, None] + kk[None, :], mask=a_ok, other=0.0)
    w = tl.load(w_cols[None, :] + kk[:, None] * stride_wc, mask=w_ok, other=0.0)
    return bf16_dot(a, w, acc, INTERP)


@triton.jit
def _tma_step(
    acc,
    k,
    a_desc,
    w_desc,
    row,
    g,
    col,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    TRANSPOSE_W: tl.constexpr,
    INTERP: tl.constexpr,
):
    """``_step`` with both tiles copied by TMA: the (BM, BK) activation tile at ``row`` and the
    weight tile of group ``g`` at output column ``col`` (fwd: ``w[g]`` (N, K) read as
    (BN, BK) and transposed; dgrad: read as (BK, BN))."""
    a = a_desc.load([row, k])
    if TRANSPOSE_W:
        w = w_desc.load([g, col, k]).reshape(BN, BK).T
    else:
        w = w_desc.load([g, k, col]).reshape(BK, BN)
    return bf16_dot(a, w, acc, INTERP)


@triton.jit
def grouped_kernel(
    A,
    stride_am,
    W,
    stride_wg,
    stride_wc,
    stride_wo,
    Out,
    stride_om,
    Splits,
    num_groups,
    n_out,
    k_red,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    MAX_G: tl.constexpr,
    NUM_PROGS: tl.constexpr,
    EVEN_K: tl.constexpr,
    TMA: tl.constexpr,
    TRANSPOSE_W: tl.constexpr,
    INTERP: tl.constexpr,
):
    """``NUM_PROGS`` programs walk the tiles of all groups; ``A`` and ``Out`` have unit column
    strides, ``W`` is addressed by group, contraction and output-column strides. With
    ``TMA``, ``A`` and ``W`` are tensor descriptors of blocks (BM, BK) and (1, BN, BK) (fwd,
    ``TRANSPOSE_W``) or (1, BK, BN) (dgrad), and the strides are unused."""
    col_tiles = tl.cdiv(n_out, BN)
    gi, starts, rows, tiles, tile_end = group_table(Splits, num_groups, BM, col_tiles, MAX_G)
    total = tl.sum(tiles, 0)
    t = tl.program_id(0)
    while t < total:
        g, start, count, row0, col = locate_first(t, gi, starts, rows, tiles, tile_end, BM)
        rm = row0 + tl.arange(0, BM)
        rn = col * BN + tl.arange(0, BN)
        m_ok = rm < count
        n_ok = rn < n_out
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if TMA:
            tile = (A, W, start + row0, g, col * BN)
            acc = contract(_tma_step, acc, 0, k_red, BK, tile, (BM, BN, BK, TRANSPOSE_W, INTERP), INTERP)
        else:
            a_rows = A + (start + rm).to(tl.int64) * stride_am
            w_cols = W + g.to(tl.int64) * stride_wg + rn.to(tl.int64) * stride_wo
            tile = (a_rows, w_cols, stride_wc, m_ok, n_ok, k_red)
            acc = contract(_step, acc, 0, k_red, BK, tile, (BK, EVEN_K, INTERP), INTERP)
        out = Out + (start + rm).to(tl.int64)[:, None] * stride_om + rn[None, :]
        tl.store(out, narrow(acc, Out.dtype.element_ty, INTERP), mask=m_ok[:, None] & n_ok[None, :])
        t += NUM_PROGS
