"""What limits the upcast kernel on decode-like calls: H200 experiments.

On a decode case of ``moe_shapes.json`` (default ``gptoss120b_gateup_decode``), balanced
(default) or skewed splits, with E2M1 (default) or E4M3 weights:

- default: times the upcast kernel (default tiles) with its sm_90 PTX decode, with the PTX
  decode without the folded scale (one more bf16x2 multiply per element pair) and with the
  portable decode (more integer instructions per element), all reading the same bytes. If
  the time follows the decode's instruction count, the SMs' instruction issue is the
  limit; if not, the weight stream is.
- ``--sweep``: times the default tile against 16-, 32- and 64-row tiles of three and four
  stages and two and three programs per SM (three capped in registers so that they fit,
  ``UpcastConfig.max_registers``), and the default with 2-block steps, interleaved with
  ``torch._grouped_mm`` on the same problem. If the time falls as more warps share an SM,
  waiting is the limit; the row tiles trade decodes of a skewed split's large groups
  against work per tile.
- ``--heights``: times two-height tiles (``UpcastConfig.small``: groups of at most
  ``small`` rows get ``small``-row tiles, larger ones ``bm``-row tiles) against the
  one-height 16- and 32-row tiles: a skewed split's large groups decode each weight tile
  once, while its small groups keep short tiles.
- ``--warps``: the weight tile over two warpgroups, or 64 weight rows on one at up to four
  programs a SM: whether register pressure (E4M3's decode tile held 235 registers a
  thread, two programs a SM, on an H100) is what keeps the weight stream short of the bytes.
- ``--steps``: on compute-bound cases, four 32-blocks a contraction step on the 256- and
  128-row tiles (8 warps) against the default's two: fewer instructions per element since
  the E2M1 words copy in 16-byte pieces at four blocks.
- ``--ncu``: launches the default kernel once, for ``ncu`` to profile.

Run from the repository root::

    python benchmarks/decode_probe.py [--case NAME] [--splits skewed] [--fmt e4m3]
        [--sweep | --heights | --warps | --steps | --ncu]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
from triton.testing import do_bench

from grouped_gemm.backends.triton_mx import launch, layouts, layouts_e4m3
from grouped_gemm.bench.shapes import select_cases
from grouped_gemm.mx import quantize_mx_weight


def _layouts(fmt: str, g: int, n: int, k: int) -> tuple[layouts.UpcastWeight, layouts.UpcastWeight]:
    """(folded, unfolded) upcast layouts of one random weight."""
    wq = quantize_mx_weight(torch.randn(g, n, k, device="cuda"), fmt)
    if fmt == "e4m3":
        return layouts_e4m3.upcast_weight_e4m3(wq), layouts_e4m3.build_upcast_weight_e4m3(wq)
    return layouts.upcast_weight(wq), layouts.build_upcast_weight(wq)


def _variants(x, lay, unfolded, splits, out, weight_bytes) -> dict:
    g = splits.numel()
    results = {}
    ptx_decode = launch.ptx_decode
    variants = (("ptx decode", True, lay), ("ptx, scale not folded", True, unfolded), ("portable decode", False, lay))
    for name, ptx, weight in variants:
        launch.ptx_decode = lambda device, ptx=ptx: ptx
        ms = do_bench(lambda weight=weight: launch.launch_upcast(x, weight, splits, out, g), warmup=25, rep=200)
        results[name] = {"us": ms * 1e3, "weight_tb_s": weight_bytes / ms / 1e9}
        print(f"{name:22s} {ms * 1e3:8.1f} us  weight stream {weight_bytes / ms / 1e9:.2f} TB/s", flush=True)
    launch.ptx_decode = ptx_decode
    return results


def _tile_grid(default: launch.UpcastConfig) -> list[launch.UpcastConfig]:
    """16-, 32- and 64-row tiles x 3 / 4 stages x 2 / 3 programs a SM, and the default at
    two blocks a step."""
    grid = [
        dataclasses.replace(default, bm=bm, stages=s, per_sm=p) for bm in (16, 32, 64) for s in (3, 4) for p in (2, 3)
    ]
    return [*grid, dataclasses.replace(default, blocks=2)]


def _height_grid(default: launch.UpcastConfig) -> list[launch.UpcastConfig]:
    """Two-height tiles (``UpcastConfig.small``: small groups get ``small``-row tiles, the
    others ``bm``) at two programs a SM, against the one-height 16- and 32-row tiles."""
    one = [
        dataclasses.replace(default, bm=16, small=0, stages=3, per_sm=3),
        dataclasses.replace(default, bm=16, small=0, stages=4, per_sm=2),
        dataclasses.replace(default, bm=32, small=0, stages=3, per_sm=2),
    ]
    two = [
        dataclasses.replace(default, bm=bm, small=small, stages=s, per_sm=2)
        for bm, small in ((32, 16), (64, 16), (64, 32))
        for s in (3, 4)
    ]
    return one + two


def _warp_grid(default: launch.UpcastConfig) -> list[launch.UpcastConfig]:
    """Register pressure: the weight tile over two warpgroups (8 warps: half the decoded
    operand a thread) at 128 and 256 weight rows, and 64-row weight tiles on one warpgroup
    at up to four programs a SM, all at the default's row heights."""
    wide = [
        dataclasses.replace(default, bn=bn, warps=8, stages=s, per_sm=p)
        for bn, per_sm in ((128, (2, 3)), (256, (1, 2)))
        for s in (3, 4)
        for p in per_sm
    ]
    narrow = [dataclasses.replace(default, bn=64, stages=s, per_sm=p) for s in (3, 4) for p in (2, 3, 4)]
    return wide + narrow


def _step_grid(default: launch.UpcastConfig) -> list[launch.UpcastConfig]:
    """Compute-bound tiles at four 32-blocks a step (16-byte E2M1 word copies since
    1e409f2) against the default's two: 256 x 128 and 128 x 128, 8 warps, 2-4 stages."""
    return [
        dataclasses.replace(default, bm=bm, bn=128, blocks=4, warps=8, stages=s, per_sm=1)
        for bm, stages in ((256, (2, 3)), (128, (3, 4)))
        for s in stages
    ]


def _sweep(x, lay, splits, out, weight_bytes, grid: list[launch.UpcastConfig], rounds: int = 3) -> dict:
    """The default and ``grid``'s tiles whose shared memory fits the SM (``SMEM_BYTES`` for
    all its programs together, sized for the weight's format), interleaved with the peer."""
    g, (m, k), n = splits.numel(), x.shape, out.shape[1]
    default = launch.upcast_config(m, g, lay.fmt)
    fits = [c for c in [default, *grid] if c.per_sm * c.smem_bytes(lay.fmt) <= launch.SMEM_BYTES]
    if lay.fmt == "e4m3":  # E4M3's layout is read four blocks a step
        fits = [c for c in fits if c.blocks == 4]
    configs = list(dict.fromkeys(fits))
    # Every tile must write what the default writes: poisoned outputs, compared bit for bit.
    expected = launch.launch_upcast(x, lay, splits, out.fill_(float("nan")), g, default).clone()
    for c in configs:
        got = launch.launch_upcast(x, lay, splits, out.fill_(float("nan")), g, c)
        if not torch.equal(got, expected):
            print(f"{c}: differs from the default tile (max |diff| {(got - expected).abs().max().item()})")
    w_bf16 = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16)
    offs = torch.cumsum(splits, 0, dtype=torch.int32)
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        ms = do_bench(lambda: torch._grouped_mm(x, w_bf16.transpose(1, 2), offs=offs), warmup=10, rep=50)
        times.setdefault("torch._grouped_mm", []).append(ms)
        for c in configs:
            ms = do_bench(lambda c=c: launch.launch_upcast(x, lay, splits, out, g, c), warmup=10, rep=50)
            times.setdefault(str(c), []).append(ms)
    peer = min(times["torch._grouped_mm"])
    results = {}
    for name, t in times.items():
        best = min(t)
        results[name] = {"us": best * 1e3, "weight_tb_s": weight_bytes / best / 1e9, "x_peer": peer / best}
        print(f"{name:90s} {best * 1e3:8.1f} us  {weight_bytes / best / 1e9:5.2f} TB/s  {peer / best:5.2f}x peer")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="gptoss120b_gateup_decode", help="a case of moe_shapes.json")
    parser.add_argument("--splits", choices=("balanced", "skewed"), default="balanced", help="group sizes")
    parser.add_argument("--fmt", choices=("e2m1", "e4m3"), default="e2m1", help="weight format")
    parser.add_argument("--sweep", action="store_true", help="stages x programs per SM, against the peer")
    parser.add_argument("--heights", action="store_true", help="two-height tiles against one-height ones")
    parser.add_argument("--warps", action="store_true", help="8-warp and 64-row weight tiles (registers)")
    parser.add_argument("--steps", action="store_true", help="four-block steps on the compute-bound tiles")
    parser.add_argument("--ncu", action="store_true", help="launch once (for ncu) instead of timing")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 2
    (case,) = select_cases(args.case)
    splits = torch.tensor(case.splits(args.splits), device="cuda", dtype=torch.int32)
    x = torch.randn(case.m, case.k, device="cuda", dtype=torch.bfloat16)
    lay, unfolded = _layouts(args.fmt, case.groups, case.n, case.k)
    out = torch.empty(case.m, case.n, device="cuda", dtype=torch.bfloat16)
    weight_bytes = lay.data.numel() * lay.data.element_size() + lay.scales.numel() * 4
    if args.ncu:
        launch.launch_upcast(x, lay, splits, out, case.groups)
        torch.cuda.synchronize()
        return 0
    if args.sweep or args.heights or args.warps or args.steps:
        default = launch.upcast_config(case.m, case.groups, args.fmt)
        grids = {"heights": _height_grid, "warps": _warp_grid, "steps": _step_grid, "sweep": _tile_grid}
        grid = next(fn for name, fn in grids.items() if getattr(args, name))(default)
        results = _sweep(x, lay, splits, out, weight_bytes, grid)
    else:
        results = _variants(x, lay, unfolded, splits, out, weight_bytes)
    print(json.dumps({"case": case.name, "splits": args.splits, "fmt": args.fmt, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
