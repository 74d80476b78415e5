"""Hopper (sm_90) grouped kernel: bf16 activations x E2M1 weights, weights upcast in registers.

``out[rows of g, :] = a[rows of g, :] @ W_g^T`` with ``W_g`` (Nr, Kc) in the upcast layout
(``layouts.UpcastWeight``): per 64-element chunk of the contraction, byte j holds element j
in its low nibble and element 32 + j in its high nibble, so one loaded byte tile yields two
(BN, 32) bf16 tiles by elementwise ops alone, each with a single scale per row (its own
32-block). The kernel computes the transposed product ``out^T = W . a^T``: the upcast
weight is the left operand, which Hopper's wgmma reads from registers, so upcast values
never go through shared memory; the packed bytes and the activations are the pipelined
shared-memory loads. Scales are stored transposed (Kp/32, Nr) so each 32-block's scales
for a row tile are one contiguous load.

The same kernel serves fwd (weight quantized along K) and dgrad (weight quantized along N,
laid out as (K, N)): only the layout differs.
"""

from __future__ import annotations

import triton
import triton.language as tl
from grouped_gemm.backends.triton_mxfp4.decode import bf16_dot, e2m1_pair_to_bf16, e2m1_pair_to_bf16_ptx
from grouped_gemm.backends.triton_mxfp4.schedule import group_table, locate


@triton.jit
def _concat_k(a, b):
    """(R, C) and (R, C) -> (R, 2C), ``a`` first along the columns. In the wgmma operand
    layout this only renames registers (the compiler emits no data movement)."""
    return tl.join(a, b).permute(0, 2, 1).reshape(a.shape[0], 2 * a.shape[1])


@triton.jit
def _weight_chunk(w_rows, scales, k, w_ok, PTX: tl.constexpr):
    """The (BN, 64) bf16 weight tile of contraction elements [k, k + 64); ``scales`` holds
    each row's E8M0 bytes of the two 32-blocks in its low 16 bits."""
    packed = tl.load(w_rows[:, None] + (k // 2 + tl.arange(0, 32))[None, :], mask=w_ok[:, None], other=0)
    e_lo = (scales & 0xFF).to(tl.uint8)[:, None]
    e_hi = ((scales >> 8) & 0xFF).to(tl.uint8)[:, None]
    if PTX:
        lo, hi = e2m1_pair_to_bf16_ptx(packed, e_lo, e_hi)
    else:
        lo, hi = e2m1_pair_to_bf16(packed, e_lo, e_hi)
    return _concat_k(lo, hi)


@triton.jit
def _step(
    acc,
    k,
    a_rows,
    w_rows,
    s_rows,
    stride_sk,
    m_ok,
    n_ok,
    k_red,
    k_padded,
    CHUNKS: tl.constexpr,
    EVEN_K: tl.constexpr,
    PTX: tl.constexpr,
    INTERP: tl.constexpr,
):
    """One contraction step of 64 * CHUNKS elements: decode the weight tile, load the
    activations, accumulate ``W . a^T``."""
    BK: tl.constexpr = 64 * CHUNKS
    # One int32 per row holds the scale bytes of the 4 blocks of [k - k % 128, +128).
    w_ok = n_ok if EVEN_K else n_ok & (k < k_padded)
    words = tl.load(s_rows + (k // 128) * stride_sk, mask=w_ok, other=0)
    if CHUNKS == 2:
        w = _weight_chunk(w_rows, words, k, w_ok, PTX)
        w_ok = n_ok if EVEN_K else n_ok & (k + 64 < k_padded)
        w = _concat_k(w, _weight_chunk(w_rows, words >> 16, k + 64, w_ok, PTX))
    else:
        w = _weight_chunk(w_rows, words >> (16 * ((k // 64) % 2)), k, w_ok, PTX)
    kk = k + tl.arange(0, BK)
    x_ok = m_ok[None, :] if EVEN_K else m_ok[None, :] & (kk < k_red)[:, None]
    x = tl.load(a_rows[None, :] + kk[:, None], mask=x_ok, other=0.0)
    return bf16_dot(w, x, acc, INTERP)


@triton.jit
def upcast_grouped_kernel(
    A,
    stride_am,
    W,
    stride_wg,
    stride_wn,
    S,
    stride_sg,
    stride_sk,
    Out,
    stride_om,
    Ends,
    num_groups,
    n_out,
    k_red,
    k_padded,
    BM: tl.constexpr,
    BN: tl.constexpr,
    CHUNKS: tl.constexpr,
    MAX_G: tl.constexpr,
    NUM_PROGS: tl.constexpr,
    EVEN_K: tl.constexpr,
    PTX: tl.constexpr,
    INTERP: tl.constexpr,
):
    BK: tl.constexpr = 64 * CHUNKS
    col_tiles = tl.cdiv(n_out, BN)
    gi, starts, rows, tiles, tile_end = group_table(Ends, num_groups, BM, col_tiles, MAX_G)
    total = tl.sum(tiles, 0)
    t = tl.program_id(0)
    while t < total:
        g, start, count, local = locate(t, gi, starts, rows, tiles, tile_end)
        row_tiles = tl.cdiv(count, BM)
        rm = (local % row_tiles) * BM + tl.arange(0, BM)
        rn = (local // row_tiles) * BN + tl.arange(0, BN)
        m_ok = rm < count
        n_ok = rn < n_out
        a_rows = A + (start + rm).to(tl.int64) * stride_am
        w_rows = W + g.to(tl.int64) * stride_wg + rn.to(tl.int64) * stride_wn
        s_rows = S + g.to(tl.int64) * stride_sg + rn
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        if INTERP:
            k = 0
            while k < k_red:
                acc = _step(
                    acc, k, a_rows, w_rows, s_rows, stride_sk, m_ok, n_ok, k_red, k_padded, CHUNKS, EVEN_K, PTX, INTERP
                )
                k += BK
        else:
            for k in range(0, k_red, BK):
                acc = _step(
                    acc, k, a_rows, w_rows, s_rows, stride_sk, m_ok, n_ok, k_red, k_padded, CHUNKS, EVEN_K, PTX, INTERP
                )
        out = Out + (start + rm).to(tl.int64)[None, :] * stride_om + rn[:, None]
        tl.store(out, acc.to(Out.dtype.element_ty), mask=m_ok[None, :] & n_ok[:, None])
        t += NUM_PROGS
