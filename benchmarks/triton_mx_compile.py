"""Compile the Triton MX kernels for sm_90, sm_100 and gfx950 without a GPU and check the code.

Triton compiles for any ``GPUTarget`` on a CPU machine (it ships ptxas and the AMD linker).
For each kernel configuration this script reports what the compiled code must show:

- sm_90 upcast kernel (E2M1 and E4M3 weights, PTX and portable decode): wgmma (``HGMMA``
  in the SASS; the weight as the register operand, so no ``STS`` / ``STSM`` in the loop:
  decoded values never pass through shared memory), registers and spills from ptxas; a
  two-height tile has one contraction loop per height, and each is checked;
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
from grouped_gemm.backends.triton_mx.launch import paired_words, upcast_config
from grouped_gemm.backends.triton_mx.scaled_kernel import scaled_grouped_kernel
from grouped_gemm.backends.triton_mx.upcast_kernel import upcast_grouped_kernel
from grouped_gemm.backends.triton_mx.wgrad_kernel import wgrad_grouped_kernel

#: The E2M1 decode tile (four rows a group), three programs a SM under a register cap.
DECODE_TILE = upcast_config(128, 32, "e2m1")
#: E2M1's compute-bound tiles (128 and 256 rows, 8 warps, four blocks a step).
COMPUTE_E2M1 = upcast_config(128 * 512, 128, "e2m1")
#: The two-height decode tiles (16 rows a group on average: 16-row tiles for small groups).
HEIGHTS_E2M1, HEIGHTS_E4M3 = upcast_config(512, 32, "e2m1"), upcast_config(512, 32, "e4m3")

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
    sig = {n: "i32" for n in kernel.arg_names}
    sig.update(pointers)
    sig.update({n: "constexpr" for n in const})
    attrs = {
        (i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n not in const and n != "num_groups"
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
    A loop the pipeliner left alone (a ``while``, or one stage) has plain loads instead."""
    ttgir, ptx = c.asm["ttgir"], c.asm["ptx"]
    before, body = _loop_body(ttgir, "ttng.warp_group_dot ")
    copy = "ttg.async_copy_global_to_local"
    rings = [int(d) for d in re.findall(r"ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x", ttgir)]
    waits = [int(n) for b in body for n in re.findall(r"ttg\.async_wait .*\{num = (\d+)", b)]
    found = {
        "prologue_copies": sum(copy in b for b in before),
        "loop_copies": sum(copy in b for b in body),
        "rings": sorted(rings),
        "loop_wait_num": waits,
        "loop_async_wgmma": sum("ttng.warp_group_dot " in b and "isAsync = true" in b for b in body),
        "shared_bytes": c.metadata.shared,
        "ptx_cp_async": len(re.findall(r"cp\.async\.c[ag]\.shared\.global", ptx)),
        "ptx_cp_async_wait_group": ptx.count("cp.async.wait_group"),
        "ptx_wgmma": ptx.count("wgmma.mma_async"),
        "ptx_wgmma_wait_group": ptx.count("wgmma.wait_group"),
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
    return (
        f"{'pipelined' if p['ok'] else 'NOT pipelined'}: cp.async prologue {p['prologue_copies']}, "
        f"loop {p['loop_copies']}, rings {'/'.join(map(str, p['rings']))}, loop wait {p['loop_wait_num']}, "
        f"async wgmma {p['loop_async_wgmma']}, smem {p['shared_bytes']} B; PTX cp.async {p['ptx_cp_async']}, "
        f"wait_group {p['ptx_cp_async_wait_group']}, wgmma {p['ptx_wgmma']}, wgmma.wait {p['ptx_wgmma_wait_group']}"
    )


def _registers(c) -> tuple[int, int]:
    """(registers a thread, stack bytes) of a compiled sm_90 kernel, from ptxas."""
    usage = re.search(r"REG:(\d+) STACK:(\d+)", _cuobjdump(c.asm["cubin"], "-res-usage"))
    return int(usage[1]), int(usage[2])


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
            "W": "*i64" if w_fmt == "e4m3" else "*i32",
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
            PAIRED=paired_words(w_fmt, blocks, warps, 128),
            TMA=False,
            INTERP=False,
        ),
        TARGETS["sm_90"],
        warps=warps,
        stages=stages,
        maxnreg=maxnreg,
    )
    decode = "" if ptx else " portable decode"
    # Four E2M1 blocks a step start a run, so a (row, q)'s four words are one 16-byte copy:
    # only the step's row scales may come in 4-byte copies (one a thread).
    narrow = 1 if w_fmt == "e2m1" and blocks == 4 else None
    capped = f" stages={stages} maxnreg={maxnreg}" if maxnreg else ""
    heights = f" SMALL={small} stages={stages}" if small else ""
    name = f"upcast {w_fmt}{decode} BM={bm} BLOCKS={blocks} FOLD={fold} warps={warps}{capped}{heights}"
    row = _sm90_row(c, name, narrow)
    if maxnreg:
        row["ok"] = row["ok"] and row["spills"] == 0
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
    words = "*i64" if fmt == "e4m3" else "*i32"
    c = _compile(
        weight_prep_kernel.quantize_upcast_kernel,
        {"w_ptr": "*i16", "data_ptr": words, "scale_ptr": "*i32"},
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


def _wgrad(arch: str, dy_fmt: str, x_fmt: str) -> dict:
    target = TARGETS[arch]
    operand = "*bf16" if dy_fmt == "bf16" else "*u8"
    c = _compile(
        wgrad_grouped_kernel,
        {"DY": operand, "DYS": operand, "X": operand, "XS": operand, "Out": "*fp32", "PEnds": "*i32"},
        dict(BN=128, BK=128, BT=64, DY_FMT=dy_fmt, X_FMT=x_fmt, ACCUMULATE=True, NUM_PROGS=148, INTERP=False),
        target,
        warps=8,
        stages=3,
    )
    name = f"wgrad {dy_fmt} x {x_fmt}"
    return _sm90_row(c, name) if arch == "sm_90" else _scaled_row(c, target, name, arch)


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
        _upcast("e4m3", True, 256, 2),
        _upcast("e4m3", False, 256, 2),
        _upcast("e4m3", True, 16, 2),
        _upcast("e4m3", True, 32, 2),
        _upcast("e4m3", True, 16, 4),
        _upcast("e4m3", True, 64, 4),
        _upcast("e4m3", True, 128, 2),
        _upcast("e2m1", True, 256, 2),
        _upcast("e2m1", True, 16, 4),
        _upcast("e2m1", True, 16, 4, stages=DECODE_TILE.stages, maxnreg=DECODE_TILE.max_registers()),
        _upcast("e2m1", True, 128, 4, stages=COMPUTE_E2M1.stages),
        _upcast("e2m1", True, 256, 4, stages=COMPUTE_E2M1.stages),
        _upcast("e2m1", True, 32, 4, stages=HEIGHTS_E2M1.stages, small=HEIGHTS_E2M1.small),
        _upcast("e4m3", True, 32, 4, stages=HEIGHTS_E4M3.stages, small=HEIGHTS_E4M3.small),
        _upcast("e4m3", True, 128, 2, warps=4),
        _upcast("e2m1", True, 128, 2, warps=4),
        _upcast("e2m1", True, 16, 4, ptx=False),
        _upcast("e4m3", True, 16, 2, ptx=False),
        _wgrad("sm_90", "bf16", "bf16"),
        *(_prep(fmt, op) for fmt in ("e2m1", "e4m3") for op in ("fwd", "dgrad")),
    ]
    for arch in ("sm_100", "gfx950"):
        rows += [_scaled(arch, "e4m3", "e4m3"), _scaled(arch, "e5m2", "e4m3"), _scaled(arch, "e4m3", "e2m1")]
        rows += [_wgrad(arch, "e4m3", "e4m3"), _wgrad(arch, "e5m2", "e4m3")]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "triton_mx_compile.json").write_text(json.dumps({"triton": triton.__version__, "rows": rows}))
    print(f"Triton {triton.__version__}")
    print("| kernel | target | ok | found | contraction loop | registers / stack bytes |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        regs = f"{r['regs']} / stack {r['spills']}" if r["regs"] is not None else ""
        pipe = _pipeline_text(r["pipeline"]) if r["pipeline"] else ""
        print(f"| {r['kernel']} | {r['target']} | {'yes' if r['ok'] else 'NO'} | {r['found']} | {pipe} | {regs} |")
    if not all(r["ok"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
