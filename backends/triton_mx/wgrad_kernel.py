"""Grouped weight-gradient kernel: ``dw_g = dy_g^T @ x_g``, contraction over each group's tokens.

``PEnds`` are the cumulative group ends, on the device. With MX formats both operands
come in the padded token layout: every group's rows start at a multiple of 32 (the scale
blocks) and the padding rows are zeros. The plain ``"bf16"`` path (bf16 or fp16 tiles)
masks every token at the group's end, so it also takes unpadded ends (``triton_grouped``).
With MX formats (``DY_FMT`` / ``X_FMT``: E2M1, E4M3 or E5M2) the operands are quantized
along the tokens (E2M1 data packed two tokens per byte, (Mp/2, N) and (Mp/2, K); the 8-bit
formats one token per byte; scales (Mp/32, N), (Mp/32, K)) and the product is
``tl.dot_scaled`` (or its fp32 emulation in the interpreter); with ``"bf16"`` they are the
exact bf16 decodes of those tensors (the Hopper path) and the product is ``tl.dot``.

Tiles are (group, N tile, K tile), group-major so programs running together share a
group's tokens in L2. With ``ACCUMULATE`` the tile is added to ``Out`` (for example an fp32
``main_grad``) and groups without tokens leave it untouched; otherwise they write zeros.
"""

from __future__ import annotations

import triton
import triton.language as tl

from grouped_gemm.backends.triton_mx.contraction import contract
from grouped_gemm.backends.triton_mx.decode import bf16_dot, narrow, to_fp32
from grouped_gemm.backends.triton_mx.scaled_kernel import emulated_dot_scaled


@triton.jit
def _step(
    acc,
    t0,
    last,
    DY,
    stride_dym,
    DYS,
    stride_dysm,
    X,
    stride_xm,
    XS,
    stride_xsm,
    rn,
    rk,
    n_ok,
    k_ok,
    BT: tl.constexpr,
    DY_FMT: tl.constexpr,
    X_FMT: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """BT tokens of the contraction from ``t0`` (MX: a multiple of 32 from a 32-row boundary)."""
    DY_PER_BYTE: tl.constexpr = 2 if DY_FMT == "e2m1" else 1
    X_PER_BYTE: tl.constexpr = 2 if X_FMT == "e2m1" else 1
    dy_tok = t0 // DY_PER_BYTE + tl.arange(0, BT // DY_PER_BYTE)
    x_tok = t0 // X_PER_BYTE + tl.arange(0, BT // X_PER_BYTE)
    dy_ok = (dy_tok * DY_PER_BYTE < last)[:, None] & n_ok[None, :]
    x_ok = (x_tok * X_PER_BYTE < last)[:, None] & k_ok[None, :]
    dy = tl.load(DY + dy_tok.to(tl.int64)[:, None] * stride_dym + rn[None, :], mask=dy_ok, other=0)
    x = tl.load(X + x_tok.to(tl.int64)[:, None] * stride_xm + rk[None, :], mask=x_ok, other=0)
    if DY_FMT == "bf16":
        acc = bf16_dot(tl.trans(dy), x, acc, EMULATE)
    else:
        blk = t0 // 32 + tl.arange(0, BT // 32)
        blk_ok = blk * 32 < last
        dys = tl.load(
            DYS + blk.to(tl.int64)[:, None] * stride_dysm + rn[None, :], mask=blk_ok[:, None] & n_ok[None, :], other=0
        )
        xs = tl.load(
            XS + blk.to(tl.int64)[:, None] * stride_xsm + rk[None, :], mask=blk_ok[:, None] & k_ok[None, :], other=0
        )
        if EMULATE:
            acc = emulated_dot_scaled(tl.trans(dy), tl.trans(dys), DY_FMT, x, tl.trans(xs), X_FMT, acc)
        else:
            acc = tl.dot_scaled(tl.trans(dy), tl.trans(dys), DY_FMT, x, tl.trans(xs), X_FMT, acc)
    return acc


@triton.jit
def wgrad_grouped_kernel(
    DY,
    stride_dym,
    DYS,
    stride_dysm,
    X,
    stride_xm,
    XS,
    stride_xsm,
    Out,
    stride_og,
    stride_on,
    PEnds,
    num_groups,
    n_out,
    k_out,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BT: tl.constexpr,
    DY_FMT: tl.constexpr,
    X_FMT: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    NUM_PROGS: tl.constexpr,
    INTERP: tl.constexpr,
):
    n_tiles = tl.cdiv(n_out, BN)
    k_tiles = tl.cdiv(k_out, BK)
    per_group = n_tiles * k_tiles
    t = tl.program_id(0)
    while t < num_groups * per_group:
        g = t // per_group
        local = t % per_group
        rn = (local // k_tiles) * BN + tl.arange(0, BN)
        rk = (local % k_tiles) * BK + tl.arange(0, BK)
        n_ok = rn < n_out
        k_ok = rk < k_out
        first = tl.load(PEnds + g - 1, mask=g > 0, other=0)
        last = tl.load(PEnds + g)
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        tile = (last, DY, stride_dym, DYS, stride_dysm, X, stride_xm, XS, stride_xsm, rn, rk, n_ok, k_ok)
        acc = contract(_step, acc, first, last, BT, tile, (BT, DY_FMT, X_FMT, INTERP), INTERP)
        out = Out + g.to(tl.int64) * stride_og + rn.to(tl.int64)[:, None] * stride_on + rk[None, :]
        mask = n_ok[:, None] & k_ok[None, :]
        if ACCUMULATE:
            # A full-tile comparison: Triton 3.9's interpreter rejects a mask built from
            # a block mask and a scalar comparison ("mask has unsupported dtype").
            mask = mask & ((tl.zeros((BN, BK), dtype=tl.int32) + last) > first)
            acc += to_fp32(tl.load(out, mask=mask, other=0.0), INTERP)
        tl.store(out, narrow(acc, Out.dtype.element_ty, INTERP), mask=mask)
        t += NUM_PROGS
