"""Hopper (sm_90) grouped kernel: bf16 activations x E2M1 or E4M3 weights, weights upcast in registers.

``out[rows of g, :] = a[rows of g, :] @ W_g^T`` with ``W_g`` (Nr, Kc) in the upcast layout
(``layouts.UpcastWeight``: int32 words of eight E2M1 codes arranged like wgmma's register
fragment). The kernel computes the transposed product ``out^T = W . a^T``: the upcast
weight is the left operand, which Hopper's wgmma reads from registers, so upcast values
never go through shared memory; the packed words, their scales and the activations are
the software-pipelined shared-memory loads (cp.async; the words 16 bytes per thread and
128 contraction elements).

The same kernel serves fwd (weight quantized along K) and dgrad (weight quantized along N,
laid out as (K, N)): only the layout differs. ``W_FMT`` picks the weight format: E2M1
(``layouts``: int32 words of eight codes) or E4M3 (``layouts_e4m3``: pairs of int32 words
of four bytes at the same fragment positions, so everything but the decode is shared).

With ``A_FMT`` set (and the quantizer's constexprs after it) the kernel quantizes each
loaded activation slab to that MX format per 32-block and decodes it before the product,
bit for bit what ``quantize_decode_kernel`` writes; the slab then goes to shared memory
for wgmma after the arithmetic (``launch.launch_upcast`` says where this runs).

With ``TMA`` the activations come through tensor descriptors instead (``A`` of ``BM``-row
blocks, ``A_SMALL`` of ``SMALL``-row ones; sm_90 and newer): the copy engine zero-fills
the contraction tail and rows past M, and a tile that runs into the next group's rows only
feeds output rows the masked store leaves out. With pointer loads ``A_SMALL`` is unused.
"""

from __future__ import annotations

import triton
import triton.language as tl

from grouped_gemm.backends.triton_mx.contraction import contract
from grouped_gemm.backends.triton_mx.decode import (
    bf16_dot,
    e2m1_words_to_bf16,
    e2m1_words_to_bf16_ptx,
    e4m3_words_to_bf16,
    e4m3_words_to_bf16_ptx,
    e8m0_to_bf16x2,
    narrow,
)
from grouped_gemm.backends.triton_mx.dequant_kernel import quantized_values
from grouped_gemm.backends.triton_mx.schedule import group_table, locate_first
from grouped_gemm.backends.triton_mx.weight_prep_kernel import E4M3_HIGH_WORDS, layout_word
from grouped_gemm.mx.triton_kernels import widen


@triton.jit
def _concat_k(a, b):
    """(R, C) and (R, C) -> (R, 2C), ``a`` first along the columns. In the wgmma operand
    layout this only renames registers (the compiler emits no data movement)."""
    return tl.join(a, b).permute(0, 2, 1).reshape(a.shape[0], 2 * a.shape[1])


@triton.jit
def _block(words, high, run_scales, b: tl.constexpr, PTX: tl.constexpr, FOLD: tl.constexpr, W_FMT: tl.constexpr):
    """The (rows, 4) words of 32-block ``b`` (word q in column q; E4M3: ``words`` and
    ``high`` hold elements j = 0, 1 and j = 2, 3) -> its (rows, 32) bf16 values in
    contraction order: decoded value j + 4h of position q is element 8j + 2q + h."""
    if W_FMT == "e2m1":
        scale = e8m0_to_bf16x2((run_scales >> (8 * b)) & 0xFF, FOLD)[:, None]
        if PTX:
            o0, o1, o2, o3, o4, o5, o6, o7 = e2m1_words_to_bf16_ptx(words, scale, FOLD)
        else:
            o0, o1, o2, o3, o4, o5, o6, o7 = e2m1_words_to_bf16(words, scale, FOLD)
    else:
        scale = e8m0_to_bf16x2((run_scales >> (8 * b)) & 0xFF, FOLD, 120)[:, None]
        if PTX:
            o0, o1, o2, o3, o4, o5, o6, o7 = e4m3_words_to_bf16_ptx(words, high, scale, FOLD)
        else:
            o0, o1, o2, o3, o4, o5, o6, o7 = e4m3_words_to_bf16(words, high, scale, FOLD)
    hj = tl.join(tl.join(tl.join(o0, o4), tl.join(o1, o5)), tl.join(tl.join(o2, o6), tl.join(o3, o7)))
    # row, q, h, j bit 0, j bit 1 -> row, j bit 1, j bit 0, q, h
    return hj.permute(0, 4, 3, 1, 2).reshape(words.shape[0], 32)


@triton.jit
def _by_block(words):
    """(rows, 4, 4) words (q, block) -> the four blocks' (rows, 4) words, in wgmma's layout."""
    rows: tl.constexpr = words.shape[0]
    w02, w13 = tl.split(words.reshape(rows, 4, 2, 2))
    w0, w2 = tl.split(w02)
    w1, w3 = tl.split(w13)
    return w0, w1, w2, w3


@triton.jit
def _quantized_activations(x, BLOCKS: tl.constexpr, INTERP: tl.constexpr, A_FMT: tl.constexpr, QUANT):
    """The (32 * BLOCKS, rows) bf16 activation slab (contraction along axis 0) with each
    row's 32-blocks quantized to ``A_FMT`` and decoded (``QUANT``: ``quantized_values``'
    constexprs after the format): the values ``quantize_decode_kernel`` would have written,
    from registers instead of a pass of their own."""
    rows: tl.constexpr = x.shape[1]
    v = widen(x.to(tl.int16, bitcast=True), True).reshape(BLOCKS, 32, rows)
    v = quantized_values(v, 1, A_FMT, *QUANT)
    return narrow(v, tl.bfloat16, INTERP).reshape(32 * BLOCKS, rows)


@triton.jit
def _step(
    acc,
    k,
    a_src,
    a_row,
    w_rows,
    stride_wr,
    s_rows,
    stride_sk,
    m_ok,
    n_ok,
    k_red,
    BLOCKS: tl.constexpr,
    EVEN_K: tl.constexpr,
    PTX: tl.constexpr,
    FOLD: tl.constexpr,
    W_FMT: tl.constexpr,
    TMA: tl.constexpr,
    INTERP: tl.constexpr,
    A_FMT: tl.constexpr,
    QUANT,
):
    """One contraction step of 32 * BLOCKS elements (BLOCKS 2 or 4, inside one 128-run and
    so inside the zero-padded layout): decode the weight tile in registers, load the
    activations (``a_src``: row pointers, or with ``TMA`` a descriptor read at row
    ``a_row``), accumulate ``W . a^T``. Every 32-block is decoded with its own row scales
    and the blocks are concatenated along K; loads, splits and joins all stay in the wgmma
    operand layout (no shared-memory round trip: docs/notes/triton_mxfp4.md). With ``A_FMT``
    the activations are quantized and decoded after the load (``_quantized_activations``)."""
    BK: tl.constexpr = 32 * BLOCKS
    if BLOCKS == 4:
        # k is a multiple of 128, so the step starts a run: a constant 0 lets a (row, q)'s
        # words load as one 16-byte piece (E4M3: two), where a runtime ``first`` made them
        # four 4-byte copies and four 4-byte shared-memory reads (every 32-byte sector
        # visited eight times a step).
        first = 0
    else:
        tl.static_assert(W_FMT == "e2m1", "E4M3 weights are decoded four blocks a step")
        first = (k % 128) // 32
    run = (k // 128) * stride_wr
    rows: tl.constexpr = w_rows.shape[0]
    # Word 4q + b (E2M1, layouts; E4M3's low halves, its high halves E4M3_HIGH_WORDS on: layouts_e4m3).
    if BLOCKS == 4:
        # A row's 16 words are contiguous: loaded as one (row, 16) tile, Triton's coalescer
        # gives each 16-byte copy of a warp the next piece of the row (four threads a row,
        # thread q holding word 4q + b of each block b: the wgmma layout). Loaded as a
        # (row, q, block) tile, the 32 threads of a copy took one piece of 32 rows each,
        # and every 32-byte sector was requested twice.
        cols = run + tl.arange(0, 16)[None, :]
        words = tl.load(w_rows[:, None] + cols, mask=n_ok[:, None], other=0).reshape(rows, 4, 4)
        if W_FMT == "e4m3":
            high = tl.load(w_rows[:, None] + cols + E4M3_HIGH_WORDS, mask=n_ok[:, None], other=0).reshape(rows, 4, 4)
    else:
        cols = run + layout_word(tl.arange(0, 4)[None, :, None], first + tl.arange(0, BLOCKS)[None, None, :])
        words = tl.load(w_rows[:, None, None] + cols, mask=n_ok[:, None, None], other=0)  # row, q, block
    run_scales = tl.load(s_rows + (k // 128) * stride_sk, mask=n_ok, other=0) >> (8 * first)
    if BLOCKS == 2:
        w0, w1 = tl.split(words)
        w = _concat_k(
            _block(w0, None, run_scales, 0, PTX, FOLD, W_FMT), _block(w1, None, run_scales, 1, PTX, FOLD, W_FMT)
        )
    else:
        w0, w1, w2, w3 = _by_block(words)
        if W_FMT == "e4m3":
            h0, h1, h2, h3 = _by_block(high)
        else:
            h0, h1, h2, h3 = None, None, None, None
        b0 = _block(w0, h0, run_scales, 0, PTX, FOLD, W_FMT)
        b1 = _block(w1, h1, run_scales, 1, PTX, FOLD, W_FMT)
        b2 = _block(w2, h2, run_scales, 2, PTX, FOLD, W_FMT)
        b3 = _block(w3, h3, run_scales, 3, PTX, FOLD, W_FMT)
        w = _concat_k(_concat_k(b0, b1), _concat_k(b2, b3))
    if TMA:
        x = a_src.load([a_row, k]).T
    else:
        kk = k + tl.arange(0, BK)
        x_ok = m_ok[None, :] if EVEN_K else m_ok[None, :] & (kk < k_red)[:, None]
        x = tl.load(a_src[None, :] + kk[:, None], mask=x_ok, other=0.0)
    if A_FMT != "":
        x = _quantized_activations(x, BLOCKS, INTERP, A_FMT, QUANT)
    return bf16_dot(w, x, acc, INTERP)


@triton.jit
def _tile(
    A,
    stride_am,
    w_rows,
    stride_wr,
    s_rows,
    stride_sk,
    Out,
    stride_om,
    start,
    count,
    row0,
    rn,
    n_ok,
    k_red,
    ROWS: tl.constexpr,
    BK: tl.constexpr,
    config,
    TMA: tl.constexpr,
    INTERP: tl.constexpr,
):
    """One output tile: ``ROWS`` token rows from ``row0`` of the group (rows from
    ``start``, ``count`` of them) by the weight rows ``rn``, contracted over ``k_red``;
    ``A`` is the activation tensor, or with ``TMA`` its descriptor of ``ROWS``-row blocks."""
    rm = row0 + tl.arange(0, ROWS)
    m_ok = rm < count
    if TMA:
        a_src = A
    else:
        a_src = A + (start + rm).to(tl.int64) * stride_am
    acc = tl.zeros((rn.shape[0], ROWS), dtype=tl.float32)
    tile = (a_src, start + row0, w_rows, stride_wr, s_rows, stride_sk, m_ok, n_ok, k_red)
    acc = contract(_step, acc, 0, k_red, BK, tile, config, INTERP)
    out = Out + (start + rm).to(tl.int64)[None, :] * stride_om + rn[:, None]
    tl.store(out, narrow(acc, Out.dtype.element_ty, INTERP), mask=m_ok[None, :] & n_ok[:, None])


@triton.jit
def _tile_of_height(
    A,
    A_SMALL,
    stride_am,
    tail,
    left,
    BM: tl.constexpr,
    SMALL: tl.constexpr,
    BK: tl.constexpr,
    config,
    TMA: tl.constexpr,
    INTERP: tl.constexpr,
):
    """``_tile`` ``SMALL`` rows high (``A_SMALL``) where the kernel has two heights and at
    most ``SMALL`` of the group's rows are ``left`` from the tile's first, else ``BM`` rows
    high (``A``): a small group's tile, or a group's ragged last one, computes no more than
    ``SMALL`` rows (on the benchmark's skewed splits 256-row tiles alone compute 1.05-1.69x
    the rows there are)."""
    if SMALL == 0:
        _tile(A, stride_am, *tail, BM, BK, config, TMA, INTERP)
    elif left <= SMALL:
        _tile(A_SMALL, stride_am, *tail, SMALL, BK, config, TMA, INTERP)
    else:
        _tile(A, stride_am, *tail, BM, BK, config, TMA, INTERP)


@triton.jit
def upcast_grouped_kernel(
    A,
    stride_am,
    A_SMALL,
    W,
    stride_wg,
    stride_wn,
    stride_wr,
    S,
    stride_sg,
    stride_sk,
    Out,
    stride_om,
    Splits,
    num_groups,
    n_out,
    k_red,
    BM: tl.constexpr,
    SMALL: tl.constexpr,
    BN: tl.constexpr,
    BLOCKS: tl.constexpr,
    MAX_G: tl.constexpr,
    NUM_PROGS: tl.constexpr,
    EVEN_K: tl.constexpr,
    PTX: tl.constexpr,
    FOLD: tl.constexpr,
    W_FMT: tl.constexpr,
    TMA: tl.constexpr,
    INTERP: tl.constexpr,
    A_FMT: tl.constexpr = "",
    RULE: tl.constexpr = 0,
    EMAX: tl.constexpr = 0,
    MAX_MANT: tl.constexpr = 0,
    MBITS: tl.constexpr = 0,
    BIAS: tl.constexpr = 0,
    MAX_VALUE: tl.constexpr = 0.0,
    NBITS: tl.constexpr = 0,
    NATIVE: tl.constexpr = False,
):
    """``NUM_PROGS`` programs walk the tiles of all groups, every ``NUM_PROGS``-th each.
    With ``SMALL`` set, a tile with at most ``SMALL`` of its group's rows left is ``SMALL``
    rows high (``_tile_of_height``), the others ``BM``: small groups and ragged tails do not
    carry ``BM`` rows of activations, while full tiles decode each weight tile fewer times."""
    BK: tl.constexpr = 32 * BLOCKS
    col_tiles = tl.cdiv(n_out, BN)
    gi, starts, rows, tiles, tile_end = group_table(Splits, num_groups, BM, col_tiles, MAX_G)
    total = tl.sum(tiles, 0)
    t = tl.program_id(0)
    while t < total:
        g, start, count, row0, col = locate_first(t, gi, starts, rows, tiles, tile_end, BM)
        rn = col * BN + tl.arange(0, BN)
        n_ok = rn < n_out
        w_rows = W + g.to(tl.int64) * stride_wg + rn.to(tl.int64) * stride_wn
        s_rows = S + g.to(tl.int64) * stride_sg + rn
        tail = (w_rows, stride_wr, s_rows, stride_sk, Out, stride_om, start, count, row0, rn, n_ok, k_red)
        # The step's constexprs go as a tuple literal: a tuple bound to a name would be
        # converted to tensors, which W_FMT (a string) cannot be.
        _tile_of_height(
            A,
            A_SMALL,
            stride_am,
            tail,
            count - row0,
            BM,
            SMALL,
            BK,
            (
                BLOCKS,
                EVEN_K,
                PTX,
                FOLD,
                W_FMT,
                TMA,
                INTERP,
                A_FMT,
                (PTX, RULE, EMAX, MAX_MANT, MBITS, BIAS, MAX_VALUE, NBITS, NATIVE),
            ),
            TMA,
            INTERP,
        )
        t += NUM_PROGS
