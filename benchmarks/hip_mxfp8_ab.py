"""A/B of hip_mxfp8 kernel builds, interleaved in one run against torch._grouped_mm bf16.

Each variant is NAME=CSRC_DIR[:DEFINE+DEFINE] (built with torch's cpp_extension, e.g.
`exact=backends/hip_mxfp8/csrc:GG_MXFP8_PRESCALE=0`), NAME=@OTHER (same build; a name ending
in T reads dgrad's weight transposed ahead of time) or a name starting with `old` (the
stop-37 binding, no layout flag). Kernels are timed alone on prequantized operands, with
bitwise equality to the first variant and SQNR against a float64 reference; `--api` adds
the public call (activations quantized per call, device splits).

python benchmarks/hip_mxfp8_ab.py --variants new=backends/hip_mxfp8/csrc --cases gptoss120b_gateup \
    --ops fwd,dgrad,wgrad --api --out ab.json
--ncu OP (fwd, dgrad or wgrad): run each variant's kernel a few times on the first case only (for ncu -k).
--build-only: build the variants and exit (a later run loads them at once), e.g. while GPU tests run.
"""

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.utils import cpp_extension

import grouped_gemm as gg
from grouped_gemm.bench.shapes import select_cases
from grouped_gemm.bench.timing import back_to_back_ms
from grouped_gemm.mx import quantize_mx, quantize_mx_rows, quantize_mx_weight
from grouped_gemm.testing import sqnr_db

p = argparse.ArgumentParser()
p.add_argument("--variants", default="new=backends/hip_mxfp8/csrc")
p.add_argument("--cases", default="dsv3_gateup_ep8,gptoss120b_gateup,qwen3_30b_gateup")
p.add_argument("--ops", default="fwd,dgrad")
p.add_argument("--splits", default="balanced,skewed")
p.add_argument("--rounds", type=int, default=5)
p.add_argument("--reps", type=int, default=10)
p.add_argument("--ncu", default=None)
p.add_argument("--out", default=None)
p.add_argument("--api", action="store_true")
p.add_argument("--scale", type=float, default=1.0)
p.add_argument("--build-only", action="store_true")
args = p.parse_args()

dev = torch.device("cuda")


def _build(name, path, defs):
    return cpp_extension.load(
        name=f"hipab_{name}",
        sources=[os.path.join(path, "binding.cu")],
        extra_include_paths=[path],
        extra_cuda_cflags=[
            "-O3",
            "-std=c++17",
            "-gencode=arch=compute_90a,code=sm_90a",
            *[f"-D{x}" for x in defs.split("+") if x],
        ],
        build_directory=_dir(name),
        verbose=False,
    )


def _dir(name):
    os.makedirs(f"/tmp/hipab_{name}", exist_ok=True)
    return f"/tmp/hipab_{name}"


specs, aliases = [], {}
for spec in args.variants.split(","):
    name, path = spec.split("=", 1)
    path, _, defs = path.partition(":")
    if path.startswith("@"):
        aliases[name] = path[1:]
    else:
        specs.append((name, path, defs))
t0 = time.time()

with ThreadPoolExecutor(len(specs) + 1) as pool:
    pkg = None
    if args.api:
        from grouped_gemm.backends.hip_mxfp8 import build as pkg_build

        pkg = pool.submit(pkg_build.ensure, "sm_90", "cuda")
    built = list(pool.map(lambda sp: _build(*sp), specs))
    if pkg is not None:
        print("package build:", pkg.result(), flush=True)
print("built", [sp[0] for sp in specs], f"{time.time() - t0:.1f}s", flush=True)
if args.build_only:
    sys.exit(0)
mods = {sp[0]: m for sp, m in zip(specs, built, strict=False)}
mods.update({name: mods[src] for name, src in aliases.items()})

TILE = 128


def prepare(op, case, kind):
    G, M, N, K = case.groups, case.m, case.n, case.k
    splits = case.splits(kind)
    gen = torch.Generator(device=dev).manual_seed(0)
    if op == "fwd":
        a_hp = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=gen)
        w_hp = torch.randn(G, N, K, device=dev, dtype=torch.bfloat16, generator=gen) * 0.05
        a = quantize_mx(a_hp, "e4m3", axis=1, pad=True)
        w = quantize_mx_weight(w_hp, "e4m3", op="fwd", pad=True)
        wd, ws = w.data.contiguous(), w.scale.contiguous()
        ncols = N

        def peer(offs):
            return torch._grouped_mm(a_hp, w_hp.transpose(-2, -1), offs=offs)
    else:
        a_hp = torch.randn(M, N, device=dev, dtype=torch.bfloat16, generator=gen)
        w_hp = torch.randn(G, N, K, device=dev, dtype=torch.bfloat16, generator=gen) * 0.05
        a = quantize_mx(a_hp, "e4m3", axis=1, pad=True)
        w = quantize_mx_weight(w_hp, "e4m3", op="dgrad", pad=True)
        wd, ws = w.data.transpose(1, 2).contiguous(), w.scale.transpose(1, 2).contiguous()
        ncols = K

        def peer(offs):
            return torch._grouped_mm(a_hp, w_hp, offs=offs)

    ends = torch.tensor(splits, device=dev).cumsum(0).to(torch.int32)
    sizes = torch.tensor(splits, device=dev)
    tile_ends = torch.cumsum((sizes + TILE - 1) // TILE, 0, dtype=torch.int32)
    max_tiles = -(-M // TILE) + G
    out = torch.empty(M, ncols, device=dev, dtype=torch.bfloat16)
    return dict(
        a=a,
        wd=wd,
        ws=ws,
        ends=ends,
        tile_ends=tile_ends,
        max_tiles=max_tiles,
        out=out,
        peer=peer,
        flops=2 * M * N * K,
        splits=splits,
        w=w,
        a_hp=a_hp,
        w_hp=w_hp,
    )


def runner(name, mod, d, op):
    ad, asc = d["a"].data.contiguous(), d["a"].scale.contiguous()
    if name.startswith("old"):
        return lambda: mod.rows_gemm(ad, asc, d["wd"], d["ws"], d["ends"], d["tile_ends"], d["max_tiles"], d["out"])
    if op == "dgrad" and not name.endswith("T"):
        wk, sk = d["w"].data.contiguous(), d["w"].scale.contiguous()
        return lambda: mod.rows_gemm(ad, asc, wk, sk, d["ends"], d["tile_ends"], d["max_tiles"], d["out"], True)
    return lambda: mod.rows_gemm(ad, asc, d["wd"], d["ws"], d["ends"], d["tile_ends"], d["max_tiles"], d["out"], False)


def interleaved(fns):
    for f in fns.values():
        for _ in range(3):
            f()
    times = {n: [] for n in fns}
    names = list(fns)
    for r in range(args.rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            fns[n]()
            times[n].append(back_to_back_ms(fns[n], args.reps))
    return {n: statistics.median(v) for n, v in times.items()}


def wgrad_operands(case, kind):
    """bf16 dy and x of a wgrad, and the quantized (token-major) operands the kernels take."""
    M, N, K = case.m, case.n, case.k
    splits = case.splits(kind)
    gen = torch.Generator(device=dev).manual_seed(0)
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16, generator=gen)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=gen)
    dy_q = quantize_mx_rows(dy, splits, "e4m3", align=32)
    x_q = quantize_mx_rows(x, splits, "e4m3", align=32)
    operands = [t.contiguous() for t in (dy_q.tensor.data, dy_q.tensor.scale, x_q.tensor.data, x_q.tensor.scale)]
    return splits, dy, x, operands, dy_q.padded_offsets[1:]


def wgrad_runner(mod, operands, ends, dst):
    """One variant's wgrad kernel on wgrad_operands' quantized operands, into dst."""
    return lambda: mod.wgrad_gemm(*operands, ends, dst, False, True)


def wgrad_row(case, kind):
    """Public API wgrad (bf16 dy and x quantized per call) against torch._grouped_mm's."""
    G, M, N, K = case.groups, case.m, case.n, case.k
    splits, dy, x, operands, ends = wgrad_operands(case, kind)
    offs = torch.tensor(splits, device=dev).cumsum(0).to(torch.int32)
    dsplits = torch.tensor(splits, device=dev)
    out = torch.empty(G, N, K, device=dev, dtype=torch.bfloat16)
    fns = {"peer": lambda: torch._grouped_mm(dy.t(), x, offs=offs)}
    if args.api:
        fns["api"] = lambda: gg.grouped_gemm_wgrad(dy, x, dsplits, recipe="mxfp8", backend="hip_mxfp8", out=out)
    want = gg.grouped_gemm_wgrad(dy, x, splits, recipe="mxfp8", backend="reference", out_dtype=torch.float32)
    # every variant's kernel on the operands the API would quantize (token-major, k-outer)
    sq, same, base = {}, {}, None
    for name, mod in mods.items():
        dst = torch.empty(G, N, K, device=dev, dtype=torch.bfloat16)
        fns[name] = wgrad_runner(mod, operands, ends, dst)
        dst.fill_(float("nan"))
        fns[name]()
        sq[name] = round(sqnr_db(dst.float(), want), 2)
        base = dst if base is None else base
        same[name] = bool(torch.equal(dst, base))
    if args.api:
        sq["api"] = round(sqnr_db(fns["api"]().float(), want), 2)
    del want
    med = interleaved(fns)
    row = dict(
        case=case.name,
        op="wgrad",
        split=kind,
        sqnr=sq,
        equal=same,
        ms={n: round(v, 4) for n, v in med.items()},
        x_peer={n: round(med["peer"] / v, 3) for n, v in med.items() if n != "peer"},
        tflops={n: round(2 * M * N * K / v / 1e9, 1) for n, v in med.items()},
    )
    rows.append(row)
    print(json.dumps(row), flush=True)


rows = []
cases = select_cases(args.cases, args.scale)
ops = args.ops.split(",")
if args.ncu:
    kind = args.splits.split(",")[0]
    if args.ncu == "wgrad":
        _, _, _, operands, ends = wgrad_operands(cases[0], kind)
        dst = torch.empty(cases[0].groups, cases[0].n, cases[0].k, device=dev, dtype=torch.bfloat16)
    else:
        d = prepare(args.ncu, cases[0], kind)
    for name, mod in mods.items():
        f = wgrad_runner(mod, operands, ends, dst) if args.ncu == "wgrad" else runner(name, mod, d, args.ncu)
        for _ in range(3):
            f()
    torch.cuda.synchronize()
    sys.exit(0)


def kernel_row(case, op, kind):
    """Every variant's kernel, and the public API, against torch._grouped_mm on one case."""
    d = prepare(op, case, kind)
    offs = d["ends"]
    fns = {"peer": (lambda: d["peer"](offs))}
    if args.api:
        dsplits = torch.tensor(d["splits"], device=dev)
        call = gg.grouped_gemm if op == "fwd" else gg.grouped_gemm_dgrad
        fns["api"] = lambda: call(d["a_hp"], d["w"], dsplits, recipe="mxfp8", backend="hip_mxfp8")
    outs = {}
    for name, mod in mods.items():
        fns[name] = runner(name, mod, d, op)
        d["out"].fill_(float("nan"))
        fns[name]()
        torch.cuda.synchronize()
        outs[name] = d["out"].clone()
    base = next(iter(outs.values()))
    same = {n: bool(torch.equal(o, base)) for n, o in outs.items()}
    # SQNR of every variant against the dequantized float64 reference on sampled rows
    w_deq = d["w"].dequantize()
    deq_a = d["a"].dequantize()
    ends = [0] + list(torch.tensor(d["splits"]).cumsum(0).tolist())
    sampled = [i for i, s in enumerate(d["splits"]) if s > 0][:: max(1, case.groups // 8)]
    picks = [(ends[g], min(4, d["splits"][g]), g) for g in sampled]  # (first row, rows, group)
    width = w_deq.shape[2] if op == "fwd" else w_deq.shape[1]
    ref = torch.cat(
        [deq_a[r : r + nr, :width].double() @ (w_deq[g].T if op == "fwd" else w_deq[g]).double() for r, nr, g in picks]
    )
    sq = {name: round(sqnr_db(torch.cat([o[r : r + nr] for r, nr, _ in picks]), ref), 2) for name, o in outs.items()}
    med = interleaved(fns)
    row = dict(
        case=case.name,
        op=op,
        split=kind,
        sqnr=sq,
        equal=same,
        ms={n: round(v, 4) for n, v in med.items()},
        x_peer={n: round(med["peer"] / v, 3) for n, v in med.items() if n != "peer"},
        tflops={n: round(d["flops"] / v / 1e9, 1) for n, v in med.items()},
    )
    rows.append(row)
    print(json.dumps(row), flush=True)
    torch.cuda.empty_cache()


for case in cases:
    for op in ops:
        for kind in args.splits.split(","):
            if op == "wgrad":
                wgrad_row(case, kind)
            else:
                kernel_row(case, op, kind)
if args.out:
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
