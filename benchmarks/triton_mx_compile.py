"""Compile the Triton MX kernels for sm_90, sm_100 and gfx950 without a GPU and check the code.

Triton compiles for any ``GPUTarget`` on a CPU machine (it ships ptxas and the AMD linker).
For each kernel configuration this script reports what the compiled code must show:

- sm_90 upcast kernel (E2M1 and E4M3 weights, PTX and portable decode, the activations
  by pointer loads): wgmma (``HGMMA`` in the SASS; the weight as the register operand, so
  no ``STS`` / ``STSM`` in the loop: decoded values never pass through shared memory),
  registers and spills from ptxas; a two-height tile has one contraction loop per height,
  and each is checked; the shared memory Triton allocated is what ``UpcastConfig.smem_bytes``
  (the tuning candidates' fit) says, up to the copy barriers;
- the same kernel at each default tile that fetches the activations through tensor
  descriptors (``UpcastConfig.tma``: the compute-bound tiles of both formats), with the
  constexprs ``launch._upcast_plan`` gives a launch: the checks above (their ``cp.async``
  copies are then the weight's), plus the activation by bulk tensor copies
  (``cp.async.bulk.tensor``) issued before the loop and inside it, and no spills;
- sm_90 quantize-and-lay-out kernels (both formats, fwd and dgrad tiles): they compile
  and spill nothing (what the interpreter accepts, the compiler can still refuse);
- sm_90 kernels (upcast, and wgrad on bf16 decodes, Hopper's wgrad): a software-pipelined
  contraction loop, from the TTGIR: loads issued as ``cp.async`` copies before the loop
  (the prologue) and inside it, into shared-memory rings at least two deep, and the wgmma
  asynchronous inside the loop; with the PTX's ``cp.async`` / ``wgmma`` counts beside it;
- sm_100 dot_scaled kernels (fwd e4m3 x e4m3, e5m2 x e4m3, wgrad): ``tcgen05.mma`` with an
  MX ``block_scale`` kind in the PTX;
- gfx950 dot_scaled kernels: ``v_mfma_scale_f32_*_f8f6f4`` in the AMDGCN assembly.

Run from the repository root (no TRITON_INTERPRET): ``python benchmarks/triton_mx_compile.py
--out DIR``; the table is printed last and the JSON written to DIR/triton_mx_compile.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: this script compiles the kernels")

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from grouped_gemm.backends.triton_mx import layouts, weight_prep_kernel
from grouped_gemm.backends.triton_mx.launch import (
    REGISTER_FILE,
    UpcastConfig,
    WgradConfig,
    _upcast_plan,
    upcast_config,
    wgrad_configs,
)
from grouped_gemm.backends.triton_mx.scaled_kernel import scaled_grouped_kernel
from grouped_gemm.backends.triton_mx.upcast_kernel import upcast_grouped_kernel
from grouped_gemm.backends.triton_mx.wgrad_kernel import wgrad_grouped_kernel

#: The E2M1 decode tile (four rows a group), three programs a SM under a register cap.
DECODE_TILE = upcast_config(128, 32, "e2m1")
#: E2M1's compute-bound tiles (128 and 256 rows, 8 warps, four blocks a step).
COMPUTE_E2M1 = upcast_config(128 * 512, 128, "e2m1")
#: The two-height decode tiles (16 rows a group on average: 16-row tiles for small groups).
HEIGHTS_E2M1, HEIGHTS_E4M3 = upcast_config(512, 32, "e2m1"), upcast_config(512, 32, "e4m3")

#: Groups of the problems whose default tiles are compiled in their TMA form, and the mean
#: rows a group tried (1 to 1024: past ``launch.py``'s last band, at 160).
TMA_GROUPS, TMA_MEAN_ROWS = 128, tuple(2**i for i in range(11))
#: SMs of the H100 / H200: a persistent grid's programs are ``per_sm`` times this.
SMS = 132
#: Options among a launch plan's ``Constexprs`` (the rest are the kernel's constexprs).
OPTIONS = ("num_warps", "num_stages", "maxnreg")

TARGETS = {
    "sm_90": GPUTarget("cuda", 90, 32),
    "sm_100": GPUTarget("cuda", 100, 32),
    "gfx950": GPUTarget("hip", "gfx950", 64),
}


def _compile(
    kernel,
    pointers: dict[str, str],
    const: dict,
    target: GPUTarget,
    warps: int,
    stages: int,
    maxnreg: int | None = None,
):
    # Constexprs left out take their defaults, as a launch binds them.
    const = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default} | const
    sig = {n: "i32" for n in kernel.arg_names}
    sig.update(pointers)
    sig.update({n: "constexpr" for n in const})
    # Integers and pointers divisible by 16, as a launch specializes them; a descriptor
    # carries no such attribute (Triton's own specialization gives it none).
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(kernel.arg_names)
        if n not in const and n != "num_groups" and not sig[n].startswith("tensordesc")
    }
    options = {"num_warps": warps, "num_stages": stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(ASTSource(kernel, sig, const, attrs), target=target, options=options)


def _cuobjdump(cubin: bytes, flag: str) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True, check=True).stdout


def _contraction_loops(sass: str) -> list[list[str]]:
    """Opcodes, as written (``LDGSTS.E.BYPASS.128``), of each innermost loop (a backward
    branch's range holding no other such loop) that holds an HGMMA: one per tile height."""
    line = r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?([^;]*);"
    lines = re.findall(line, sass, re.M)
    code = [(int(addr, 16), op, mods, rest) for addr, op, mods, rest in lines]
    spans = []
    for addr, op, _, rest in code:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target[1], 16) < addr:
            body = [(o, o + m) for a, o, m, _ in code if int(target[1], 16) <= a <= addr]
            if any(o == "HGMMA" for o, _ in body):
                spans.append((int(target[1], 16), addr, [full for _, full in body]))
    # A branch from code placed after a loop back into its body (the out-of-line retry of a
    # TMA barrier's wait) closes no loop of its own: its range would take in the epilogue.
    spans = [s for s in spans if not any(o[0] < s[0] <= o[1] < s[1] for o in spans)]
    innermost = [s for s in spans if not any(o is not s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    return [body for _, _, body in innermost]


def _loop_body(ir: str, op: str) -> tuple[list[str], list[str]]:
    """(lines before, lines inside) the innermost ``scf.for`` whose body holds ``op``: MLIR
    prints a region's closing brace at its opening line's indentation."""
    lines = ir.splitlines()
    found: tuple[list[str], list[str]] = ([], [])
    for i, line in enumerate(lines):
        if "scf.for" not in line:
            continue
        indent = len(line) - len(line.lstrip())
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith(" " * indent + "}"))
        body = lines[i + 1 : end]
        if any(op in b for b in body) and (not found[1] or len(body) < len(found[1])):
            found = (lines[:i], body)
    return found


def _pipeline(c) -> dict:
    """How the sm_90 contraction loop is software-pipelined, from the TTGIR (and the PTX).

    ``ok`` needs all of: ``cp.async`` copies (``ttg.async_copy_global_to_local``) issued
    before the loop and inside it, shared-memory rings (``ttg.local_alloc`` of a
    ``stages x tile`` buffer) at least two deep, and an asynchronous wgmma inside the loop.
    A loop the pipeliner left alone (a ``while``, or one stage) has plain loads instead.
    Tensor-descriptor copies (``ttng.async_tma_copy_global_to_local``, the PTX's
    ``cp.async.bulk.tensor``) are counted apart: ``_upcast_tma`` holds its rows to them."""
    ttgir, ptx = c.asm["ttgir"], c.asm["ptx"]
    before, body = _loop_body(ttgir, "ttng.warp_group_dot ")
    copy, tma = "ttg.async_copy_global_to_local", "ttng.async_tma_copy_global_to_local"
    rings = [int(d) for d in re.findall(r"ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x", ttgir)]
    waits = [int(n) for b in body for n in re.findall(r"ttg\.async_wait .*\{num = (\d+)", b)]
    found = {
        "prologue_copies": sum(copy in b for b in before),
        "loop_copies": sum(copy in b for b in body),
        "prologue_tma": sum(tma in b for b in before),
        "loop_tma": sum(tma in b for b in body),
        "rings": sorted(rings),
        "loop_wait_num": waits,
        "loop_async_wgmma": sum("ttng.warp_group_dot " in b and "isAsync = true" in b for b in body),
        "shared_bytes": c.metadata.shared,
        "ptx_cp_async": len(re.findall(r"cp\.async\.c[ag]\.shared\.global", ptx)),
        "ptx_cp_async_wait_group": ptx.count("cp.async.wait_group"),
        "ptx_wgmma": ptx.count("wgmma.mma_async"),
        "ptx_wgmma_wait_group": ptx.count("wgmma.wait_group"),
        "ptx_bulk_tensor": ptx.count("cp.async.bulk.tensor"),
    }
    found["ok"] = (
        found["prologue_copies"] > 0
        and found["loop_copies"] > 0
        and bool(rings)
        and min(rings) >= 2
        and found["loop_async_wgmma"] > 0
    )
    return found


def _pipeline_text(p: dict) -> str:
    tma = (
        f"; TMA prologue {p['prologue_tma']}, loop {p['loop_tma']}, PTX cp.async.bulk.tensor {p['ptx_bulk_tensor']}"
        if p["prologue_tma"] + p["loop_tma"] + p["ptx_bulk_tensor"]
        else ""
    )
    return (
        f"{'pipelined' if p['ok'] else 'NOT pipelined'}: cp.async prologue {p['prologue_copies']}, "
        f"loop {p['loop_copies']}, rings {'/'.join(map(str, p['rings']))}, loop wait {p['loop_wait_num']}, "
        f"async wgmma {p['loop_async_wgmma']}, smem {p['shared_bytes']} B; PTX cp.async {p['ptx_cp_async']}, "
        f"wait_group {p['ptx_cp_async_wait_group']}, wgmma {p['ptx_wgmma']}, wgmma.wait {p['ptx_wgmma_wait_group']}"
        f"{tma}"
    )


def _registers(c) -> tuple[int, int]:
    """(registers a thread, stack and local-memory bytes) of a compiled sm_90 kernel, from
    ptxas: spilled registers go to the stack frame."""
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", _cuobjdump(c.asm["cubin"], "-res-usage"))
    return int(usage[1]), int(usage[2]) + int(usage[3])


def _sm90_row(c, name: str, narrow_copies_max: int | None = None) -> dict:
    """The SASS, register and pipelining checks of an sm_90 kernel; ``narrow_copies_max``:
    the most 4-byte ``cp.async`` copies (``LDGSTS.E``) its contraction loop may issue."""
    sass = _cuobjdump(c.asm["cubin"], "-sass")
    regs, spills = _registers(c)
    # Every contraction loop (two in a two-height kernel) is held to the checks: the worst
    # count of each opcode is the row's, and each loop's length is reported.
    loops = _contraction_loops(sass) or [[]]
    count = {}
    for written in loops:
        body = [op.split(".")[0] for op in written]
        mine = {op: body.count(op) for op in ("HGMMA", "PRMT", "STS", "STSM", "HMUL2")}
        mine["narrow_copies"] = written.count("LDGSTS.E")
        count = {op: max(n, count.get(op, 0)) for op, n in mine.items()}
    pipe = _pipeline(c)
    found = (
        f"inner loop{'s' if len(loops) > 1 else ''}: {' / '.join(str(len(w)) for w in loops)} instructions, "
        f"HGMMA {count['HGMMA']}, STS {count['STS']}, STSM {count['STSM']}, PRMT {count['PRMT']}, "
        f"HMUL2 {count['HMUL2']}, 4-byte copies {count['narrow_copies']}"
    )
    narrow_ok = narrow_copies_max is None or count["narrow_copies"] <= narrow_copies_max
    return {
        "kernel": name,
        "target": "sm_90",
        "ok": count["HGMMA"] > 0 and count["STS"] + count["STSM"] == 0 and pipe["ok"] and narrow_ok,
        "counts": count,
        "warps": c.metadata.num_warps,
        "found": found,
        "pipeline": pipe,
        "regs": regs,
        "spills": spills,
    }


def _with_smem_estimate(row: dict, c, config: UpcastConfig, w_fmt: str) -> dict:
    """Hold ``UpcastConfig.smem_bytes`` (what tuning and the probes fit candidates by) to
    what Triton allocated: at least that, and over it by no more than the barrier slack."""
    estimate, actual = config.smem_bytes(w_fmt), c.metadata.shared
    row["smem_estimate"] = estimate
    row["ok"] = row["ok"] and actual <= estimate <= actual + 16 * config.stages
    return row


def _narrow_copies_max(blocks: int, warps: int) -> int | None:
    """Four blocks a step start a run, so a (row, q)'s four words are one 16-byte copy (E4M3:
    two, its low and high halves): only the step's row scales may come in 4-byte copies, in
    the weight tile's row layout (four threads a row): one a thread on 4 warps, two on 8
    (64 rows a pass over the 128-row tile)."""
    return (1 if warps == 4 else 2) if blocks == 4 else None


def _upcast(
    w_fmt: str,
    fold: bool,
    bm: int,
    blocks: int,
    ptx: bool = True,
    warps: int | None = None,
    stages: int = 4,
    maxnreg: int | None = None,
    small: int = 0,
) -> dict:
    """An upcast tile of 128 weight rows; with ``maxnreg`` (a capped tile) it must also
    spill nothing."""
    warps = warps or (8 if bm >= 128 else 4)
    c = _compile(
        upcast_grouped_kernel,
        {
            "A": "*bf16",
            "A_SMALL": "*bf16",
            "W": "*i32",
            "S": "*i32",
            "Out": "*bf16",
            "Splits": "*i32",
        },
        dict(
            BM=bm,
            SMALL=small,
            BN=128,
            BLOCKS=blocks,
            MAX_G=128,
            NUM_PROGS=132,
            EVEN_K=True,
            PTX=ptx,
            FOLD=fold,
            W_FMT=w_fmt,
            TMA=False,
            INTERP=False,
        ),
        TARGETS["sm_90"],
        warps=warps,
        stages=stages,
        maxnreg=maxnreg,
    )
    decode = "" if ptx else " portable decode"
    capped = f" stages={stages} maxnreg={maxnreg}" if maxnreg else ""
    heights = f" SMALL={small} stages={stages}" if small else ""
    name = f"upcast {w_fmt}{decode} BM={bm} BLOCKS={blocks} FOLD={fold} warps={warps}{capped}{heights}"
    row = _sm90_row(c, name, _narrow_copies_max(blocks, warps))
    if maxnreg:
        row["ok"] = row["ok"] and row["spills"] == 0
    config = UpcastConfig(bm=bm, bn=128, blocks=blocks, warps=warps, stages=stages, per_sm=1, small=small)
    return _with_smem_estimate(row, c, config, w_fmt)


def _tma_defaults() -> list[tuple[str, int]]:
    """(weight format, mean rows a group) of each default upcast tile that fetches the
    activations through tensor descriptors (``tma``), at the first mean that picks it."""
    found, seen = [], set()
    for w_fmt in ("e2m1", "e4m3"):
        for rows in TMA_MEAN_ROWS:
            config = upcast_config(rows * TMA_GROUPS, TMA_GROUPS, w_fmt)
            if config.tma and (w_fmt, config) not in seen:
                seen.add((w_fmt, config))
                found.append((w_fmt, rows))
    return found


def _compile_planned(kwargs: dict, a: str, a_small: str):
    """The sm_90 upcast kernel compiled with a launch plan's constexprs and options
    (``kwargs``), its activations typed ``a`` / ``a_small`` (pointers or descriptors)."""
    pointers = {"A": a, "A_SMALL": a_small, "W": "*i32", "S": "*i32", "Out": "*bf16", "Splits": "*i32"}
    const = {n: v for n, v in kwargs.items() if n not in OPTIONS}
    options = {"warps": kwargs["num_warps"], "stages": kwargs["num_stages"], "maxnreg": kwargs["maxnreg"]}
    return _compile(upcast_grouped_kernel, pointers, const, TARGETS["sm_90"], **options)


def _upcast_tma(w_fmt: str, mean_rows: int) -> dict:
    """The default upcast tile at ``mean_rows`` a group in its TMA form, compiled with the
    constexprs and options ``launch._upcast_plan`` gives a launch (PTX decode, scales folded,
    N = K = 4096) but ``NUM_PROGS``, which follows the device's SMs: an H200's here."""
    m = mean_rows * TMA_GROUPS
    config = upcast_config(m, TMA_GROUPS, w_fmt)
    _, plan, _, (big, small), _ = _upcast_plan(
        interp=False,
        ptx=True,
        m=m,
        groups=TMA_GROUPS,
        w_fmt=w_fmt,
        rows=4096,
        k_red=4096,
        small_scales=True,
        device=torch.device("cpu"),
        config=None,
    )
    kwargs = plan.replace(NUM_PROGS=SMS * config.per_sm).kwargs
    if not kwargs["TMA"]:
        raise RuntimeError(f"{w_fmt} at {mean_rows} rows a group: the launch plan dropped the tile's TMA")
    c = _compile_planned(kwargs, f"tensordesc<bf16[{big[0]}, {big[1]}]>", f"tensordesc<bf16[{small[0]}, {small[1]}]>")
    name = (
        f"upcast {w_fmt} BM={config.bm} BLOCKS={config.blocks} FOLD=True warps={config.warps} "
        f"stages={config.stages} TMA (default at {mean_rows} rows a group)"
    )
    row = _sm90_row(c, name, _narrow_copies_max(config.blocks, config.warps))
    # ``_sm90_row``'s checks hold as they are: its cp.async copies and 4-byte-copy count are
    # the weight's words and scales here (still pointer loads). The activation, which
    # pointer rows load by cp.async, must come by bulk tensor copies, issued before the loop
    # and inside it (part of the pipelining check); and nothing may spill.
    pipe = row["pipeline"]
    pipe["ok"] = pipe["ok"] and pipe["ptx_bulk_tensor"] > 0 and pipe["prologue_tma"] > 0 and pipe["loop_tma"] > 0
    row["ok"] = row["ok"] and pipe["ok"] and row["regs"] <= 255 and row["spills"] == 0
    return _with_smem_estimate(row, c, config, w_fmt)


def _upcast_fused(w_fmt: str, a_fmt: str, mean_rows: int) -> dict:
    """The default decode tile at ``mean_rows`` a group (pointer loads) quantizing its bf16
    activations itself, with the constexprs ``launch._upcast_plan`` gives an MX route's
    launch: wgmma with the weight pipelined as before and nothing spilled. Its ``STS`` are
    the quantized activation slab's stores (wgmma's right operand is read from shared
    memory), so the row does not hold them to zero."""
    groups, n, k = 8, 1024, 1024  # a weight within ``FUSED_MAX_WEIGHT``: the launch fuses
    m = mean_rows * groups
    config = upcast_config(m, groups, w_fmt)
    *_, fused = plan_args = _upcast_plan(
        False, True, m, groups, w_fmt, n, k, True, torch.device("cpu"), None, (a_fmt, "rceil")
    )
    kwargs = plan_args[1].replace(NUM_PROGS=SMS * config.per_sm).kwargs
    if not fused or kwargs["TMA"]:
        raise RuntimeError(f"{w_fmt} at {mean_rows} rows a group: not a fused pointer-load tile ({config})")
    c = _compile_planned(kwargs, "*bf16", "*bf16")
    name = (
        f"quantizing upcast {w_fmt} BM={config.bm} SMALL={config.small} stages={config.stages}, {a_fmt} "
        f"activations (default at {mean_rows} rows a group)"
    )
    row = _sm90_row(c, name, _narrow_copies_max(config.blocks, config.warps))
    row["ok"] = row["counts"]["HGMMA"] > 0 and row["pipeline"]["ok"] and row["spills"] == 0
    return row


def _prep(fmt: str, op: str) -> dict:
    """The quantize-and-lay-out kernel at its default tile, as a launch specializes it (unit
    stride along the contiguous axis): it must compile, with no register spills."""
    rows, warps = layouts.DEFAULT_TILES[fmt, op]
    rows_contiguous = op == "dgrad"
    weight = torch.zeros(1, dtype=torch.bfloat16).view(torch.int16)
    const = dict(
        **({"sw_row": 1} if rows_contiguous else {"sw_k": 1}),
        ROWS=rows,
        FROM_FIRST=layouts.THREADS_FROM_FIRST_AXIS,
        ROWS_CONTIGUOUS=rows_contiguous,
        **layouts.prep_format_args(weight, fmt, "floor", rows_contiguous),
    )
    c = _compile(
        weight_prep_kernel.quantize_upcast_kernel,
        {"w_ptr": "*i16", "data_ptr": "*i32", "scale_ptr": "*i32"},
        const,
        TARGETS["sm_90"],
        warps=warps,
        stages=1,
    )
    regs, spills = _registers(c)
    return {
        "kernel": f"prep {fmt} {op}",
        "target": "sm_90",
        "ok": spills == 0,
        "found": f"{rows} rows x {warps} warps compiled",
        "pipeline": None,
        "regs": regs,
        "spills": spills,
    }


_MMA = {"cuda": re.compile(r"tcgen05\.mma[.\w:]*block_scale[.\w:]*"), "hip": re.compile(r"v_mfma_scale_f32_\w+")}


def _scaled(arch: str, a_fmt: str, w_fmt: str) -> dict:
    target = TARGETS[arch]
    c = _compile(
        scaled_grouped_kernel,
        {
            "A": "*bf16" if a_fmt == "bf16" else "*u8",
            "AS": "*u8",
            "W": "*u8",
            "WS": "*u8",
            "Out": "*bf16",
            "Splits": "*i32",
        },
        dict(BM=128, BN=128, BK=128, A_FMT=a_fmt, W_FMT=w_fmt, MAX_G=128, NUM_PROGS=148, EVEN_K=True, INTERP=False),
        target,
        warps=8,
        stages=3,
    )
    return _scaled_row(c, target, f"dot_scaled fwd {a_fmt} x {w_fmt}", arch)


#: Shared memory of one sm_90 SM, shared by its resident blocks (228 KB; one block may take
#: 227 KB of it: the CUDA C++ Programming Guide, compute capability 9.0).
SMEM_PER_SM = 228 * 1024


def _wgrad(arch: str, dy_fmt: str, x_fmt: str, config: WgradConfig | None = None) -> dict:
    """The wgrad kernel at ``config`` (the default's tiles where None). A config of more
    than one program a SM must fit that many in the register file and shared memory, or
    the second only queues (what its candidacy in ``wgrad_configs`` relies on)."""
    target = TARGETS[arch]
    cfg = config or WgradConfig(bn=128, bk=128, bt=64, warps=8, stages=3)
    operand = "*bf16" if dy_fmt == "bf16" else "*u8"
    c = _compile(
        wgrad_grouped_kernel,
        {"DY": operand, "DYS": operand, "X": operand, "XS": operand, "Out": "*fp32", "PEnds": "*i32"},
        dict(BN=cfg.bn, BK=cfg.bk, BT=cfg.bt, DY_FMT=dy_fmt, X_FMT=x_fmt, ACCUMULATE=True, NUM_PROGS=148, INTERP=False),
        target,
        warps=cfg.warps,
        stages=cfg.stages,
    )
    name = f"wgrad {dy_fmt} x {x_fmt}" + (f" {cfg.bn}x{cfg.bk}, {cfg.per_sm} a SM" if config else "")
    if arch != "sm_90":
        return _scaled_row(c, target, name, arch)
    row = _sm90_row(c, name)
    threads = cfg.per_sm * cfg.warps * 32
    row["ok"] = row["ok"] and row["regs"] * threads <= REGISTER_FILE and cfg.per_sm * c.metadata.shared <= SMEM_PER_SM
    return row


def _scaled_row(c, target: GPUTarget, name: str, arch: str) -> dict:
    text = c.asm["ptx"] if target.backend == "cuda" else c.asm["amdgcn"]
    found = sorted(set(_MMA[target.backend].findall(text)))
    return {
        "kernel": name,
        "target": arch,
        "ok": bool(found),
        "found": ", ".join(found) or "none",
        "pipeline": None,
        "regs": None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="directory for triton_mx_compile.json")
    args = parser.parse_args()
    rows = [
        _upcast("e4m3", True, 256, 4, stages=COMPUTE_E2M1.stages),
        _upcast("e4m3", False, 256, 4, stages=COMPUTE_E2M1.stages),
        _upcast("e4m3", True, 128, 4, stages=COMPUTE_E2M1.stages),
        _upcast("e4m3", True, 16, 4),
        _upcast("e4m3", True, 64, 4),
        _upcast("e2m1", True, 256, 2),
        _upcast("e2m1", True, 16, 4),
        _upcast("e2m1", True, 16, 4, stages=DECODE_TILE.stages, maxnreg=DECODE_TILE.max_registers()),
        _upcast("e2m1", True, 128, 4, stages=COMPUTE_E2M1.stages),
        _upcast("e2m1", True, 256, 4, stages=COMPUTE_E2M1.stages),
        _upcast("e2m1", True, 32, 4, stages=HEIGHTS_E2M1.stages, small=HEIGHTS_E2M1.small),
        _upcast("e4m3", True, 32, 4, stages=HEIGHTS_E4M3.stages, small=HEIGHTS_E4M3.small),
        _upcast("e2m1", True, 128, 2, warps=4),
        _upcast("e2m1", True, 16, 4, ptx=False),
        _upcast("e4m3", True, 16, 4, ptx=False),
        *(_upcast_tma(fmt, rows) for fmt, rows in _tma_defaults()),
        *(_upcast_fused(w, a, rows) for w, a in (("e4m3", "e4m3"), ("e2m1", "e2m1")) for rows in (2, 16)),
        _wgrad("sm_90", "bf16", "bf16"),
        *(_wgrad("sm_90", "bf16", "bf16", c) for c in wgrad_configs() if c.per_sm > 1 and c.bn * c.bk < 128 * 128),
        *(_prep(fmt, op) for fmt in ("e2m1", "e4m3") for op in ("fwd", "dgrad")),
    ]
    for arch in ("sm_100", "gfx950"):
        rows += [_scaled(arch, "e4m3", "e4m3"), _scaled(arch, "e5m2", "e4m3"), _scaled(arch, "e4m3", "e2m1")]
        rows += [_wgrad(arch, "e4m3", "e4m3"), _wgrad(arch, "e5m2", "e4m3")]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "triton_mx_compile.json").write_text(json.dumps({"triton": triton.__version__, "rows": rows}))
    print(f"Triton {triton.__version__}")
    print("| kernel | target | ok | found | contraction loop | registers / stack + local bytes |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        regs = f"{r['regs']} / {r['spills']}" if r["regs"] is not None else ""
        pipe = _pipeline_text(r["pipeline"]) if r["pipeline"] else ""
        print(f"| {r['kernel']} | {r['target']} | {'yes' if r['ok'] else 'NO'} | {r['found']} | {pipe} | {regs} |")
    if not all(r["ok"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
