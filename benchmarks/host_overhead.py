"""Host time per grouped-GEMM call on a GPU host, against ``torch._grouped_mm`` called directly.

A tiny problem (G=8, 8 rows per group, N=K=256, bf16) keeps the GPU ahead of the host, so
the wall time of a long run of calls, synchronized once at the end, is the host's cost per
call. Each round times every variant in a block of ``--calls`` calls right after a block
of the bare call, in an order rotated from round to round; a variant's cost over bare is
the median over rounds of its block minus the bare block beside it. Paired blocks cancel
the drift of a shared host (on one H100 host the unpaired median of one variant read
+8.8 to +26.5 us over bare across runs of the same code, 2026-12-06); the best block of
each over the best bare block is printed beside it. One call of each variant is run under
the profiler to count the kernels it launches. Three rows at 128 groups (2 rows each)
come with their own bare call (read them against it).
The Triton routes run twice, with grouped_gemm's cached launcher and through Triton's own
``kernel[grid]`` path (``GROUPED_GEMM_TRITON_LAUNCHER=triton``), interleaved in one run.
``--profile`` then runs each variant under cProfile for ``--calls`` calls and writes the 25
functions with the most own time and the 40 with the most cumulative time to
``DIR/profile/<variant>.txt``: where the host time goes.

    python benchmarks/host_overhead.py [--calls 300] [--rounds 15] [--out DIR] [--profile] [--only WORDS]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import pathlib
import pstats
import re
import statistics
import time
from collections.abc import Callable

import torch

import grouped_gemm as gg

G, ROWS, N, K = 8, 8, 256, 256


def _variants(device: torch.device) -> dict[str, Callable[[], object]]:
    """Every call variant, each a closure over its own prepared operands."""
    m = G * ROWS
    x = torch.randn(m, K, device=device, dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device=device, dtype=torch.bfloat16) / K**0.5
    host = [ROWS] * G
    dev64 = torch.tensor(host, device=device, dtype=torch.int64)
    dev32 = dev64.to(torch.int32)
    offs = torch.cumsum(dev32, 0, dtype=torch.int32)
    wt = w.transpose(-2, -1)
    dy = torch.randn(m, N, device=device, dtype=torch.bfloat16)
    w_mx = gg.quantize_mx_weight(w, "e2m1", op="fwd")
    w_e4m3 = gg.quantize_mx_weight(w, "e4m3", op="fwd")
    offs_dev = gg.offsets(dev32)  # built once, reused by every call (one per step in a model)
    offs_host = gg.offsets(host, device=device)
    peer = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    variants: dict[str, Callable[[], object]] = {
        "torch._grouped_mm, int32 offsets": lambda: peer(x, wt, offs=offs),
        "gg bf16, host splits": lambda: gg.grouped_gemm(x, w, host),
        "gg bf16, int64 device splits": lambda: gg.grouped_gemm(x, w, dev64),
        "gg bf16, int32 device splits": lambda: gg.grouped_gemm(x, w, dev32),
        "gg bf16, gg.offsets(device) reused": lambda: gg.grouped_gemm(x, w, offs_dev),
        "gg bf16, gg.offsets(host list) reused": lambda: gg.grouped_gemm(x, w, offs_host),
        "gg.offsets(device) + gg bf16, per call": lambda: gg.grouped_gemm(x, w, gg.offsets(dev32)),
        "gg a16w4 (MXTensor w), device splits": lambda: gg.grouped_gemm(x, w_mx, dev32, recipe="a16w4"),
        "gg a16w4 (MXTensor w), host splits": lambda: gg.grouped_gemm(x, w_mx, host, recipe="a16w4"),
        "gg a16w4 (bf16 w), device splits": lambda: gg.grouped_gemm(x, w, dev32, recipe="a16w4"),
        "gg bf16 multistream, host splits": lambda: gg.grouped_gemm(x, w, host, backend="multistream"),
        # The MX recipes that quantize the bf16 activations per call (one more launch).
        "gg mxfp4 (MXTensor w), device splits": lambda: gg.grouped_gemm(x, w_mx, dev32, recipe="mxfp4"),
        "gg mxfp8 (MXTensor w), device splits": lambda: gg.grouped_gemm(x, w_e4m3, dev32, recipe="mxfp8"),
        # wgrad (dy is (M, N)): the MX recipes quantize dy and x along the tokens per group.
        # grouped-gemm bench read 1.0-1.75 ms of host time per mxfp8 wgrad call on an H100
        # (2026-12-06, both mxfp8 backends, every case), against 25-40 us for the peer.
        "gg bf16 wgrad, gg.offsets(device) reused": lambda: gg.grouped_gemm_wgrad(dy, x, offs_dev),
        "gg mxfp8 wgrad, device splits": lambda: gg.grouped_gemm_wgrad(dy, x, dev32, recipe="mxfp8"),
    }
    for name in [n for n in variants if "a16w4" in n]:
        variants[f"{name}, Triton launch path"] = _through_triton_path(variants[name])
    # Token counts change from step to step in decode and training: calls alternating between
    # two M of one bucket (the same route, a Problem per M).
    short = m - G  # ROWS - 1 rows a group: the same M bucket and largest-group bucket
    x_short, dev32_short = x[:short], torch.full((G,), ROWS - 1, device=device, dtype=torch.int32)
    offs_short = gg.offsets(dev32_short)
    variants["gg bf16, gg.offsets(device) reused, M alternating"] = _alternating(
        lambda: gg.grouped_gemm(x, w, offs_dev), lambda: gg.grouped_gemm(x_short, w, offs_short)
    )
    variants["gg a16w4 (MXTensor w), device splits, M alternating"] = _alternating(
        lambda: gg.grouped_gemm(x, w_mx, dev32, recipe="a16w4"),
        lambda: gg.grouped_gemm(x_short, w_mx, dev32_short, recipe="a16w4"),
    )
    variants.update(_many_groups(device))
    return variants


def _many_groups(device: torch.device) -> dict[str, Callable[[], object]]:
    """A 128-expert layer's call (2 rows per group): host work that grows with G (checking
    the splits, their facts, their ends) shows here. Read against its own bare call."""
    groups, rows = 128, 2
    x = torch.randn(groups * rows, K, device=device, dtype=torch.bfloat16)
    w = torch.randn(groups, N, K, device=device, dtype=torch.bfloat16) / K**0.5
    host = [rows] * groups
    ends = torch.tensor(list(itertools.accumulate(host)), device=device, dtype=torch.int32)
    wt = w.transpose(-2, -1)
    peer = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    offs = gg.offsets(host, device=device)
    return {
        "torch._grouped_mm, int32 offsets, 128 groups": lambda: peer(x, wt, offs=ends),
        "gg bf16, host splits, 128 groups": lambda: gg.grouped_gemm(x, w, host),
        "gg bf16, gg.offsets(host list) reused, 128 groups": lambda: gg.grouped_gemm(x, w, offs),
    }


def selected(variants: dict[str, Callable[[], object]], only: str) -> dict[str, Callable[[], object]]:
    """The first (bare) variant and those whose name contains a word of ``only``; all of
    them when ``only`` is empty. The bare call stays: every row is read against it."""
    words = [w.strip() for w in only.split(",") if w.strip()]
    names = list(variants)
    keep = [n for i, n in enumerate(names) if i == 0 or not words or any(w in n for w in words)]
    return {n: variants[n] for n in keep}


def _alternating(*calls: Callable[[], object]) -> Callable[[], object]:
    """One call of ``calls`` in turn per call."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def _through_triton_path(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with the cached launcher off for the call (two flag writes, well under 1 us)."""
    from grouped_gemm import triton_launcher as launcher

    def call() -> object:
        previous = launcher.set_enabled(False)
        try:
            return fn()
        finally:
            launcher.set_enabled(previous)

    return call


def _host_us(fn: Callable[[], object], calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def _kernels(fn: Callable[[], object]) -> int:
    """Device kernels (and memcpys) one call launches."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _profile(fn: Callable[[], object], calls: int, path: pathlib.Path) -> None:
    """The 25 functions with the most own time (tottime), then the 40 with the most time
    under them (cumulative: which step of the call path costs what), over ``calls`` calls."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(40)
    path.write_text(text.getvalue())


def paired_rows(
    variants: dict[str, Callable[[], object]],
    calls: int,
    rounds: int,
    timer: Callable[[Callable[[], object], int], float],
) -> list[dict]:
    """Per variant: its median block (us a call), the median over rounds of its block minus
    the bare block timed just before it, and its best block minus the best bare block. The
    first variant is the bare call; ``timer(fn, calls)`` times one block."""
    names = list(variants)
    bare = names[0]
    blocks: dict[str, list[float]] = {name: [] for name in names}
    over: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            base = timer(variants[bare], calls)
            blocks[bare].append(base)
            if name == bare:
                over[bare].append(0.0)
                continue
            took = timer(variants[name], calls)
            blocks[name].append(took)
            over[name].append(took - base)
    best_bare = min(blocks[bare])
    return [
        {
            "variant": name,
            "host_us": statistics.median(blocks[name]),
            "over_bare_us": statistics.median(over[name]),
            "best_over_best_us": min(blocks[name]) - best_bare,
        }
        for name in names
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--profile", action="store_true", help="cProfile each variant into DIR/profile (needs --out)")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated words: time the bare call and the variants whose name has one of them "
        "(e.g. 'a16w4,reused'; every variant by default)",
    )
    args = parser.parse_args()
    if args.profile and args.out is None:
        parser.error("--profile writes its files under --out DIR")
    device = torch.device("cuda")
    variants = selected(_variants(device), args.only)
    runnable = {}
    for name, fn in variants.items():
        try:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            runnable[name] = fn
        except Exception as exc:  # noqa: BLE001 - a variant that cannot run here is reported, not fatal
            print(f"skipped {name}: {type(exc).__name__}: {exc}")
    rows = paired_rows(runnable, args.calls, args.rounds, _host_us)
    for row in rows:
        row["kernels"] = _kernels(runnable[row["variant"]])
    props = torch.cuda.get_device_properties(device)
    meta = {"device": props.name, "torch": torch.__version__, "grouped_gemm": gg.__version__}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_overhead.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"{meta}  G={G} rows/group={ROWS} N={N} K={K} bf16, {args.calls} calls x {args.rounds} rounds")
    print(f"{'variant':<64}{'host us/call':>14}{'vs bare':>10}{'best vs best':>14}{'kernels':>9}")
    for row in rows:
        print(
            f"{row['variant']:<64}{row['host_us']:>14.1f}{row['over_bare_us']:>+10.1f}"
            f"{row['best_over_best_us']:>+14.1f}{row['kernels']:>9}"
        )
    if args.profile:  # after the timing, which the profiler would slow down
        folder = args.out / "profile"
        folder.mkdir(parents=True, exist_ok=True)
        for name, fn in runnable.items():
            _profile(fn, args.calls, folder / f"{re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')}.txt")
        print(f"profiles: {folder}")


if __name__ == "__main__":
    main()
