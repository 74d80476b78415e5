"""Would the sm_90 MX GEMM gain from quantizing its bf16 weights itself? An H100 / H200 probe.

In training the weights change every step, so each MX fwd / dgrad call first runs a weight
pass (``layouts.quantize_upcast_weight``: read the bf16 weight, write E4M3 codes and scales)
and then the upcast GEMM reads the codes back. Where the weight is the larger operand (128
experts of 128-256 tokens) that pass costs about as much as the GEMM (docs/performance.md,
"The thirty-fourth session"). A GEMM that loads the bf16 weight and quantizes each 32-block
in registers (``dequant_kernel.quantized_values``, bit for bit the quantizer's rule) moves
the peer's bytes; it repeats the quantization once per row tile of a group (1-4.5 times on
the probe's cases, against 16-24 times for the activations in ``fused_activation_probe.py``).
Timed on an H200 ("The thirty-fifth session"), it cost 0.52-12.2 weight passes: the lead is
closed, and the probe stays to show why.

This times, kernel alone (``triton.testing.do_bench``, L2 flushed), interleaved over rounds:
``torch._grouped_mm`` bf16; the library's weight pass alone and its two-launch MX call
(weight pass, activation pass, upcast GEMM); and one plain Triton grouped kernel (pointer
loads, ``tl.dot``, one tile per program) built twice, ``QUANT=0`` (bf16 weight as given)
and ``QUANT=1`` (weight quantized to E4M3 in registers), both on the decoded activations.
``fused - plain`` is the in-register quantization's cost; set against the weight pass it
says whether the lead is worth building into the upcast kernel. The fused output is
checked against the library's two launches (same operand values; only the summation order
differs).

    python benchmarks/fused_weight_probe.py [--cases NAMES] [--splits balanced,skewed]
        [--ops fwd,dgrad] [--rounds 3] [--bm 128 --bn 128 --bk 64 --warps 8 --stages 3]
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

import grouped_gemm as gg
from grouped_gemm.backends.triton_mx import launch, layouts
from grouped_gemm.backends.triton_mx.contraction import contract
from grouped_gemm.backends.triton_mx.decode import bf16_dot, narrow, to_fp32
from grouped_gemm.backends.triton_mx.dequant_kernel import quantized_values
from grouped_gemm.bench.shapes import select_cases
from grouped_gemm.mx.formats import FORMATS
from grouped_gemm.mx.triton_quantizer import format_constants
from grouped_gemm.testing import sqnr_db

CASES = "qwen3_30b_gateup,qwen3_30b_down,gptoss120b_gateup,gptoss120b_down,dsv3_gateup_ep8"


@triton.jit
def _step(
    acc,
    k0,
    A,
    b_base,
    rows,
    end,
    cs,
    cols,
    red,
    stride_br,
    stride_bc,
    QUANT: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    quantizer,
    INTERP: tl.constexpr,
):
    """One BK-deep step of the probe's product; with ``QUANT`` each (32, BN) slab of the
    B tile (32-blocks along the contraction) is quantized to E4M3 and decoded first."""
    ks = k0 + tl.arange(0, BK)
    a = tl.load(
        A + rows.to(tl.int64)[:, None] * red + ks[None, :], mask=(rows < end)[:, None] & (ks < red)[None, :], other=0.0
    )
    b = tl.load(
        b_base + ks.to(tl.int64)[:, None] * stride_br + cs[None, :] * stride_bc,
        mask=(ks < red)[:, None] & (cs < cols)[None, :],
        other=0.0,
    )
    if QUANT:
        values = quantized_values(tl.reshape(to_fp32(b, INTERP), (BK // 32, 32, BN)), 1, "e4m3", *quantizer)
        b = narrow(tl.reshape(values, (BK, BN)), tl.bfloat16, INTERP)
    return bf16_dot(a, b, acc, INTERP)


@triton.jit
def probe_kernel(
    A,
    B,
    C,
    tile_group,
    tile_row,
    group_end,
    red,
    cols,
    stride_bg,
    stride_br,
    stride_bc,
    QUANT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    HW_E4M3: tl.constexpr,
    RULE: tl.constexpr,
    EMAX: tl.constexpr,
    MAX_MANT: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_VALUE: tl.constexpr,
    NBITS: tl.constexpr,
    NATIVE: tl.constexpr,
    INTERP: tl.constexpr,
):
    """C[rows of the tile's group] = A[rows, red] @ B_g[red, cols] for one (BM, BN) tile."""
    t = tl.program_id(0)
    g = tl.load(tile_group + t)
    rows = tl.load(tile_row + t) + tl.arange(0, BM)
    end = tl.load(group_end + g)
    cs = tl.program_id(1) * BN + tl.arange(0, BN)
    tile = (A, B + g.to(tl.int64) * stride_bg, rows, end, cs, cols, red, stride_br, stride_bc)
    acc = contract(
        _step,
        tl.zeros((BM, BN), dtype=tl.float32),
        0,
        red,
        BK,
        tile,
        # A tuple literal: one bound to a name would be converted to tensors.
        (QUANT, BN, BK, (HW_E4M3, RULE, EMAX, MAX_MANT, MBITS, BIAS, MAX_VALUE, NBITS, NATIVE), INTERP),
        INTERP,
    )
    tl.store(
        C + rows.to(tl.int64)[:, None] * cols + cs[None, :],
        narrow(acc, tl.bfloat16, INTERP),
        mask=(rows < end)[:, None] & (cs < cols)[None, :],
    )


def tile_table(splits: list[int], bm: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(group, first row) of every BM-row tile, and each group's end row (int32, on device)."""
    groups, rows, ends, start = [], [], [], 0
    for g, size in enumerate(splits):
        for r in range(start, start + size, bm):
            groups.append(g)
            rows.append(r)
        start += size
        ends.append(start)
    as_tensor = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    return as_tensor(groups), as_tensor(rows), as_tensor(ends)


@functools.cache
def _quantizer(device: torch.device) -> dict[str, int]:
    """The E4M3 quantizer's constexprs on ``device`` (bf16 input loaded as bf16), worked out
    once rather than in every timed call."""
    constants = format_constants(torch.bfloat16, device, FORMATS["e4m3"], "rceil")
    del constants["BF16_BITS"]
    return constants


def probe(a, w, tiles, op, quant, cfg, out) -> torch.Tensor:
    """The probe kernel's ``op`` product of decoded activations ``a`` and bf16 ``w`` (G, N, K)
    over ``tiles`` (``tile_table``'s, made once: the timed call does no host work)."""
    _, n, k = w.shape
    red, cols = (k, n) if op == "fwd" else (n, k)
    # fwd: B_g[k, n] = W_g[n, k]; dgrad: B_g[n, k] = W_g[n, k].
    stride_br, stride_bc = (1, k) if op == "fwd" else (k, 1)
    tile_group, tile_row, group_end = tiles
    grid = (tile_group.numel(), triton.cdiv(cols, cfg.bn))
    probe_kernel[grid](
        a, w, out, tile_group, tile_row, group_end, red, cols, n * k, stride_br, stride_bc,
        QUANT=quant, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, HW_E4M3=a.is_cuda, **_quantizer(a.device), INTERP=not a.is_cuda,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    return out


def _problem(case, kind: str, op: str, cfg, rounds: int) -> None:
    splits = case.splits(kind)
    g, m, n, k = case.groups, sum(splits), case.n, case.k
    w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    sizes = torch.tensor(splits, device="cuda", dtype=torch.int32)
    offs = torch.cumsum(sizes, 0, dtype=torch.int32)
    x = torch.randn(m, k if op == "fwd" else n, device="cuda", dtype=torch.bfloat16)
    peer_w, cols = (w.transpose(1, 2), n) if op == "fwd" else (w, k)
    out = torch.empty(m, cols, device="cuda", dtype=torch.bfloat16)
    decoded = launch.quantize_decode(x, "e4m3", "rceil")
    tiles = tile_table(splits, cfg.bm, x.device)

    def two_launches() -> torch.Tensor:
        lay = layouts.quantize_upcast_weight(w, op, "rceil", fmt="e4m3")
        return launch.launch_upcast(launch.quantize_decode(x, "e4m3", "rceil"), lay, sizes, out, g)

    library = two_launches().clone()
    fused = probe(decoded, w, tiles, op, 1, cfg, torch.full_like(out, float("nan"))).clone()
    plain = probe(decoded, w, tiles, op, 0, cfg, torch.full_like(out, float("nan"))).clone()
    print(
        f"{case.name} {kind} {op}: fused vs library SQNR {sqnr_db(fused, library):.1f} dB, "
        f"plain vs library {sqnr_db(plain, library):.1f} dB",
        flush=True,
    )
    calls = {
        "torch._grouped_mm": lambda: torch._grouped_mm(x, peer_w, offs=offs),
        "weight pass": lambda: layouts.quantize_upcast_weight(w, op, "rceil", fmt="e4m3"),
        "activation pass": lambda: launch.quantize_decode(x, "e4m3", "rceil"),
        "library two launches": two_launches,
        "probe plain": lambda: probe(decoded, w, tiles, op, 0, cfg, out),
        "probe fused": lambda: probe(decoded, w, tiles, op, 1, cfg, out),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds):
        names = list(calls)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(do_bench(calls[name], warmup=10, rep=40) * 1e3)
    best = {name: min(t) for name, t in times.items()}
    peer = best["torch._grouped_mm"]
    for name, us in best.items():
        print(f"{case.name:20s} {kind:9s} {op:5s} {name:22s} {us:9.1f} us {peer / us:6.2f}x peer", flush=True)
    cost = best["probe fused"] - best["probe plain"]
    print(
        f"{case.name:20s} {kind:9s} {op:5s} in-register quantization {cost:.1f} us "
        f"= {cost / best['weight pass']:.2f} weight passes; fused + activation pass "
        f"{peer / (best['probe fused'] + best['activation pass']):.2f}x peer",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=CASES)
    parser.add_argument("--splits", default="balanced,skewed")
    parser.add_argument("--ops", default="fwd,dgrad")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bm", type=int, default=128)
    parser.add_argument("--bn", type=int, default=128)
    parser.add_argument("--bk", type=int, default=64)
    parser.add_argument("--warps", type=int, default=8)
    parser.add_argument("--stages", type=int, default=3)
    cfg = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
          f"grouped_gemm {gg.__version__}; tile {cfg.bm} x {cfg.bn} x {cfg.bk}, {cfg.warps} warps, "
          f"{cfg.stages} stages")  # fmt: skip
    for case in select_cases(cfg.cases):
        for kind in cfg.splits.split(","):
            for op in cfg.ops.split(","):
                _problem(case, kind, op, cfg, cfg.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
