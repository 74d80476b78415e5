"""The upcast kernel's schedule and tiles with bf16 weights: Triton's own ceiling for it.

``triton_mxfp4``'s Hopper kernel computes ``out^T = W . x^T`` over the persistent
group/tile schedule of ``schedule.py``. This kernel does the same with the weight already
in bf16 (read from memory, no decode), so ``benchmarks/triton_mxfp4.py --sweep`` can split
the gap to ``torch._grouped_mm`` into what Triton's pipeline costs and what the decode
costs. Benchmark-only: the library never launches it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from grouped_gemm.backends.triton_mx.schedule import group_table, locate, max_groups_bucket


@triton.jit
def bf16_probe_kernel(
    A,
    stride_am,
    W,
    stride_wg,
    stride_wn,
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
):
    col_tiles = tl.cdiv(n_out, BN)
    gi, starts, rows, tiles, tile_end = group_table(Splits, num_groups, BM, col_tiles, MAX_G, 0)
    total = tl.sum(tiles, 0)
    for t in range(tl.program_id(0), total, NUM_PROGS):
        g, start, count, rm, rn = locate(t, gi, starts, rows, tiles, tile_end, BM, BN)
        m_ok = rm < count
        n_ok = rn < n_out
        a_rows = A + (start + rm).to(tl.int64) * stride_am
        w_rows = W + g.to(tl.int64) * stride_wg + rn.to(tl.int64) * stride_wn
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for k in range(0, k_red, BK):
            kk = k + tl.arange(0, BK)
            w = tl.load(w_rows[:, None] + kk[None, :], mask=n_ok[:, None] & (kk < k_red)[None, :], other=0.0)
            x = tl.load(a_rows[None, :] + kk[:, None], mask=m_ok[None, :] & (kk < k_red)[:, None], other=0.0)
            acc = tl.dot(w, x, acc)
        out = Out + (start + rm).to(tl.int64)[None, :] * stride_om + rn[:, None]
        tl.store(out, acc.to(Out.dtype.element_ty), mask=m_ok[None, :] & n_ok[:, None])


def launch_bf16_probe(
    x: torch.Tensor,
    w: torch.Tensor,
    splits: torch.Tensor,
    out: torch.Tensor,
    bm: int,
    bn: int,
    bk: int,
    warps: int,
    stages: int,
) -> torch.Tensor:
    """``out[rows of g] = x[rows of g] @ w[g]^T`` (bf16 ``x`` (M, K), ``w`` (G, N, K))."""
    groups, n_out, k_red = w.shape
    programs = torch.cuda.get_device_properties(x.device).multi_processor_count
    bf16_probe_kernel[(programs,)](
        x,
        x.stride(0),
        w,
        w.stride(0),
        w.stride(1),
        out,
        out.stride(0),
        splits,
        groups,
        n_out,
        k_red,
        BM=bm,
        BN=bn,
        BK=bk,
        MAX_G=max_groups_bucket(groups),
        NUM_PROGS=programs,
        num_warps=warps,
        num_stages=stages,
    )
    return out
