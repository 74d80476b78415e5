"""Grouped fwd / dgrad kernel on ``tl.dot_scaled`` (chips with MX block-scaled MMA: gfx950, sm_100).

``out[rows of g, :] = a[rows of g, :] @ W_g^T`` where ``a`` is bf16, E4M3, E5M2 or packed E2M1
with its E8M0 scales along the contraction, and ``W_g`` is an E2M1 (``triton_mxfp4``) or
E4M3 (``triton_mxfp8``, ``W_FMT``) weight read straight from its ``MXTensor`` (no
re-layout): fwd passes the weight quantized along K (data (G, N, K / per byte)), dgrad
the weight quantized along N (data (G, N / per byte, K)); the strides say which.

Triton's interpreter has no ``dot_scaled`` (triton 3.6: ``InterpreterBuilder`` lacks
``create_dot_scaled``, and the format strings reach the interpreter unwrapped); with
``EMULATE`` the kernel decodes both operands to fp32 and uses ``tl.dot`` instead, so every
index, mask and scale position is still exercised on the CPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from grouped_gemm.backends.triton_mx.contraction import contract
from grouped_gemm.backends.triton_mx.decode import (
    e2m1_to_fp32,
    e4m3_to_fp32,
    e5m2_to_fp32,
    e8m0_to_fp32,
    narrow,
    to_fp32,
)
from grouped_gemm.backends.triton_mx.schedule import group_table, locate


@triton.jit
def _expand_blocks(scale, ROWS: tl.constexpr, BLOCKS: tl.constexpr):
    """(ROWS, BLOCKS) fp32 scales -> (ROWS, 32 * BLOCKS), each repeated over its block."""
    return tl.broadcast_to(scale[:, :, None], (ROWS, BLOCKS, 32)).reshape(ROWS, 32 * BLOCKS)


@triton.jit
def _unpack_last(packed):
    """(R, C) packed E2M1 bytes -> (R, 2C) fp32, element 2i from the low nibble of byte i."""
    pair = tl.join(e2m1_to_fp32(packed & 15), e2m1_to_fp32(packed >> 4))
    return pair.reshape(packed.shape[0], 2 * packed.shape[1])


@triton.jit
def _mx_values(codes, scale, FMT: tl.constexpr):
    """(R, C) codes of an MX format, packed along the last axis, and their (R, blocks)
    E8M0 scales -> the (R, K) fp32 values (exact); bf16 / fp16 tiles are just widened
    (``to_fp32``: this emulation runs in the interpreter only)."""
    if FMT == "bf16" or FMT == "fp16":
        v = to_fp32(codes, True)
    else:
        if FMT == "e2m1":
            v = _unpack_last(codes)
        elif FMT == "e4m3":
            v = e4m3_to_fp32(codes)
        else:
            v = e5m2_to_fp32(codes)
        v = v * _expand_blocks(e8m0_to_fp32(scale), v.shape[0], v.shape[1] // 32)
    return v


@triton.jit
def emulated_dot_scaled(lhs, lhs_scale, LHS_FMT: tl.constexpr, rhs, rhs_scale, RHS_FMT: tl.constexpr, acc):
    """``tl.dot_scaled(lhs, lhs_scale, LHS_FMT, rhs, rhs_scale, RHS_FMT, acc)`` from exact
    fp32 decodes (both operands packed along the contraction)."""
    a = _mx_values(lhs, lhs_scale, LHS_FMT)
    b = tl.trans(_mx_values(tl.trans(rhs), rhs_scale, RHS_FMT))
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _step(
    acc,
    k,
    A,
    rows64,
    stride_am,
    AS,
    stride_asm,
    w_cols,
    stride_wk,
    ws_rows,
    stride_sk,
    m_ok,
    n_ok,
    k_red,
    BK: tl.constexpr,
    A_FMT: tl.constexpr,
    W_FMT: tl.constexpr,
    EVEN_K: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """One contraction step of BK elements."""
    A_PER_BYTE: tl.constexpr = 2 if A_FMT == "e2m1" else 1
    W_PER_BYTE: tl.constexpr = 2 if W_FMT == "e2m1" else 1
    ka = k // A_PER_BYTE + tl.arange(0, BK // A_PER_BYTE)
    kw = k // W_PER_BYTE + tl.arange(0, BK // W_PER_BYTE)
    kb = k // 32 + tl.arange(0, BK // 32)
    if EVEN_K:
        a_ok = m_ok[:, None]
        w_ok = n_ok[None, :]
        ws_ok = n_ok[:, None]
    else:
        a_ok = m_ok[:, None] & (ka * A_PER_BYTE < k_red)[None, :]
        w_ok = n_ok[None, :] & (kw * W_PER_BYTE < k_red)[:, None]
        ws_ok = n_ok[:, None] & (kb * 32 < k_red)[None, :]
    a = tl.load(A + rows64[:, None] * stride_am + ka[None, :], mask=a_ok, other=0)
    w = tl.load(w_cols[None, :] + kw.to(tl.int64)[:, None] * stride_wk, mask=w_ok, other=0)
    w_scale = tl.load(ws_rows[:, None] + kb[None, :] * stride_sk, mask=ws_ok, other=0)
    if A_FMT == "bf16":
        a_scale = None
    else:
        as_ok = m_ok[:, None] if EVEN_K else m_ok[:, None] & (kb * 32 < k_red)[None, :]
        a_scale = tl.load(AS + rows64[:, None] * stride_asm + kb[None, :], mask=as_ok, other=0)
    if EMULATE:
        acc = emulated_dot_scaled(a, a_scale, A_FMT, w, w_scale, W_FMT, acc)
    else:
        acc = tl.dot_scaled(a, a_scale, A_FMT, w, w_scale, W_FMT, acc)
    return acc


@triton.jit
def scaled_grouped_kernel(
    A,
    stride_am,
    AS,
    stride_asm,
    W,
    stride_wg,
    stride_wk,
    stride_wn,
    WS,
    stride_sg,
    stride_sk,
    stride_sn,
    Out,
    stride_om,
    Splits,
    num_groups,
    n_out,
    k_red,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    A_FMT: tl.constexpr,
    W_FMT: tl.constexpr,
    MAX_G: tl.constexpr,
    NUM_PROGS: tl.constexpr,
    EVEN_K: tl.constexpr,
    INTERP: tl.constexpr,
):
    col_tiles = tl.cdiv(n_out, BN)
    gi, starts, rows, tiles, tile_end = group_table(Splits, num_groups, BM, col_tiles, MAX_G)
    total = tl.sum(tiles, 0)
    t = tl.program_id(0)
    while t < total:
        g, start, count, rm, rn = locate(t, gi, starts, rows, tiles, tile_end, BM, BN)
        m_ok = rm < count
        n_ok = rn < n_out
        rows64 = (start + rm).to(tl.int64)
        w_cols = W + g.to(tl.int64) * stride_wg + rn.to(tl.int64) * stride_wn
        ws_rows = WS + g.to(tl.int64) * stride_sg + rn.to(tl.int64) * stride_sn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        tile = (A, rows64, stride_am, AS, stride_asm, w_cols, stride_wk, ws_rows, stride_sk, m_ok, n_ok, k_red)
        acc = contract(_step, acc, 0, k_red, BK, tile, (BK, A_FMT, W_FMT, EVEN_K, INTERP), INTERP)
        out = Out + rows64[:, None] * stride_om + rn[None, :]
        tl.store(out, narrow(acc, Out.dtype.element_ty, INTERP), mask=m_ok[:, None] & n_ok[None, :])
        t += NUM_PROGS


def block_k_for(k_red: int) -> int:
    """The contraction step: 128, or 64 when that divides K and 128 does not."""
    return 64 if k_red % 128 and not k_red % 64 else 128
