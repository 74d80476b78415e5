"""hip_mxfp8 on any machine: build outcomes as reasons, the cache key and lock, what it
declares on described chips, and (where nvcc is installed) the compiled kernel's SASS.

The kernels themselves run only on a GPU: tests/test_hip_mxfp8.py (``pytest -m gpu``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm import cli
from grouped_gemm.backends.hip_mxfp8 import backend as hip_backend
from grouped_gemm.backends.hip_mxfp8 import build
from grouped_gemm.backends.hip_mxfp8.backend import HipMxfp8Backend
from grouped_gemm.backends.triton_mx.mxfp8 import TritonMxfp8Backend
from grouped_gemm.mx.tensor import decode_scales

CUDA_TORCH = torch.version.cuda is not None and torch.cuda.is_available()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh cache directory and no remembered build outcomes, for one test."""
    root = tmp_path / "cache"
    monkeypatch.setenv(build.CACHE_ENV, str(root))
    build.forget()
    yield root
    build.forget()


def _reasons(device: str, **kw) -> list[gg.Reason]:
    fields = dict(op="fwd", recipe="mxfp8", groups=8, m=4096, n=1024, k=1024, device=device)
    fields.update(kw)
    return list(gg.explain(**fields).candidate("hip_mxfp8").reasons)


@pytest.mark.skipif(CUDA_TORCH, reason="checks the failure path of a torch that cannot build CUDA code")
def test_cpu_torch_gives_a_build_reason_with_its_log(cache):
    reasons = _reasons("sm_90")
    assert [r.code for r in reasons] == ["build"]
    message = reasons[0].message
    assert "not a CUDA build" in message and torch.__version__ in message
    log = Path(message.rsplit("log: ", 1)[1])
    assert log.is_file() and log.parent.parent == cache
    assert "not a CUDA build" in log.read_text()
    table = gg.explain(op="fwd", recipe="mxfp8", groups=8, m=4096, n=1024, k=1024, device="sm_90").table()
    assert "[build]" in table and str(log) in table
    # Decided once per process: the log is not rewritten by the next check.
    log.write_text("kept\n")
    assert _reasons("sm_90", m=999)[0].code == "build"
    assert log.read_text() == "kept\n"


@pytest.mark.skipif(CUDA_TORCH, reason="checks the failure path of a torch that cannot build CUDA code")
def test_cli_build_and_backends_report_the_failure(cache, capsys):
    assert cli.main(["build", "hip_mxfp8"]) == 1
    printed = capsys.readouterr().out
    assert printed.startswith("hip_mxfp8: not built: [build] ")
    assert cli.main(["build", "reference"]) == 0
    assert "nothing to build" in capsys.readouterr().out
    assert cli.main(["backends", "--arch", "sm_90"]) == 0
    listing = capsys.readouterr().out
    section = listing.split("hip_mxfp8 ", 1)[1].split("\n\n", 1)[0]
    assert "here: unavailable: [build]" in section
    assert "status: not built for sm_90" in section


def test_compile_failure_is_a_result_with_the_compiler_log(cache, monkeypatch):
    monkeypatch.setattr(build, "blocker", lambda vendor: None)

    def failing(arch: str, directory: Path) -> None:
        raise RuntimeError("Error building extension 'x'\nbinding.cu(3): error: something is wrong")

    outcome = build.attempt("sm_90", "cuda", failing)
    assert not outcome.ok
    assert outcome.error == "build failed: Error building extension 'x'"
    assert outcome.log == build.build_dir("sm_90") / build.LOG_NAME
    assert "binding.cu(3): error: something is wrong" in outcome.log.read_text()
    reason = f"{outcome}"
    assert "not built for sm_90" in reason and str(outcome.log) in reason


def test_a_compile_is_announced_and_a_load_is_not(cache, monkeypatch, caplog):
    """A first call that compiles for a minute says so (a warning, once per build); loading
    an up-to-date build says nothing."""
    from torch.utils import cpp_extension

    loads = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: loads.append(kw) or object())
    directory = build.build_dir("sm_90")
    directory.mkdir(parents=True, exist_ok=True)
    with caplog.at_level("WARNING", logger="grouped_gemm"):
        build.compile_extension("sm_90", directory)
    compiled = [r for r in caplog.records if r.name == "grouped_gemm.backends.hip_mxfp8"]
    assert len(compiled) == 1 and "compiling hip_mxfp8 for sm_90" in compiled[0].getMessage()
    assert str(directory) in compiled[0].getMessage() and "grouped-gemm build hip_mxfp8" in compiled[0].getMessage()
    (directory / f"{loads[0]['name']}.so").write_bytes(b"")
    caplog.clear()
    with caplog.at_level("WARNING", logger="grouped_gemm"):
        build.compile_extension("sm_90", directory)
    assert len(loads) == 2 and not caplog.records


def test_cache_root_and_key(cache, monkeypatch, tmp_path):
    assert build.cache_root() == cache
    monkeypatch.delenv(build.CACHE_ENV)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert build.cache_root() == tmp_path / "home" / ".cache" / "grouped_gemm"
    key = build.build_key("sm_90")
    assert re.fullmatch(r"hip_mxfp8-sm_90-torch[A-Za-z0-9._]+-[0-9a-f]{16}", key)
    assert build.build_key("sm_89") != key and build.build_key("sm_89").replace("sm_89", "sm_90") == key
    assert re.sub(r"[^A-Za-z0-9.]+", "_", torch.__version__) in key


def test_source_hash_follows_every_source(monkeypatch, tmp_path):
    copy = tmp_path / "csrc"
    shutil.copytree(build.CSRC, copy)
    monkeypatch.setattr(build, "CSRC", copy)
    before = build.source_hash()
    for name in build.SOURCES:
        path = copy / name
        original = path.read_bytes()
        path.write_bytes(original + b"\n")
        assert build.source_hash() != before, name
        path.write_bytes(original)
    assert build.source_hash() == before
    assert sorted(p.name for p in build.CSRC.iterdir() if p.suffix in (".cu", ".cuh")) == sorted(build.SOURCES)


_TWO_BUILDERS = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from grouped_gemm.backends.hip_mxfp8 import build

    build.blocker = lambda vendor: None
    count = Path(sys.argv[1])

    def compile_once(arch, directory):
        marker = directory / "built"
        if not marker.exists():
            with count.open("a") as f:
                f.write("compile\\n")
            time.sleep(1.0)
            marker.write_text("ok")
        return build  # any module stands in for the extension

    print(build.attempt("sm_90", "cuda", compile_once).ok)
    """
)


@pytest.mark.slow
def test_two_processes_build_once(cache, tmp_path):
    count = tmp_path / "compiles.txt"
    env = {**os.environ, build.CACHE_ENV: str(cache)}
    procs = [
        subprocess.Popen([sys.executable, "-c", _TWO_BUILDERS, str(count)], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outputs == ["True", "True"]
    assert count.read_text() == "compile\n"


def test_locked_excludes_a_second_holder(tmp_path):
    probe = textwrap.dedent(
        """
        import fcntl, sys
        handle = open(sys.argv[1], "a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            print("free")
        except BlockingIOError:
            print("held")
        """
    )
    lock = tmp_path / "d" / ".lock"
    with build.locked(tmp_path / "d"):
        held = subprocess.run([sys.executable, "-c", probe, str(lock)], capture_output=True, text=True, check=True)
    free = subprocess.run([sys.executable, "-c", probe, str(lock)], capture_output=True, text=True, check=True)
    assert (held.stdout.strip(), free.stdout.strip()) == ("held", "free")


def _codes(reasons: list[gg.Reason]) -> list[str]:
    return [r.code for r in reasons if r.code != "build"]


def test_declared_on_cuda_archs(cache):
    assert _codes(_reasons("sm_90")) == []
    assert _codes(_reasons("sm_90", n=200, k=136, splits="skewed", device_splits=True)) == []
    assert _codes(_reasons("sm_90", op="wgrad", out_dtype="float32", accumulate=True)) == []
    # sm_89's 99 KB of shared memory per block cannot hold the kernels' stages.
    refused = _reasons("sm_89")
    assert [r.code for r in refused] == ["arch"] and "99 KB" in refused[0].message
    assert [r.code for r in _reasons("sm_80")] == ["arch"]
    assert [r.code for r in _reasons("sm_100")] == ["arch"]
    assert "placement" in [r.code for r in _reasons("cpu")]
    assert [r.code for r in _reasons("sm_90", recipe="mxfp4")] == ["recipe"]
    assert [r.code for r in _reasons("sm_90", recipe="bf16")] == ["recipe"]
    assert _codes(_reasons("sm_90", out_dtype="float16")) == ["dtype"]


def test_e5m2_gradients_are_refused(cache):
    backend = HipMxfp8Backend()
    problem = gg.describe_problem(op="dgrad", recipe="mxfp8", groups=4, m=256, n=256, k=256, device="sm_90")
    reasons = backend.check(dataclasses.replace(problem, grad_format="e5m2"))
    assert [r.code for r in reasons] == ["recipe"] and "e5m2" in reasons[0].message
    assert _codes(backend.check(dataclasses.replace(problem, grad_format="e4m3"))) == []


def test_wgrad_operand_kinds(cache):
    backend = HipMxfp8Backend()
    problem = gg.describe_problem(op="wgrad", recipe="mxfp8", groups=4, m=256, n=256, k=256, device="sm_90")
    mixed = dataclasses.replace(problem, a_format="mx_e4m3")
    assert [r.code for r in backend.check(mixed)] == ["layout"]
    both = dataclasses.replace(problem, a_format="mx_e4m3", b_format="mx_e4m3")
    assert _codes(backend.check(both)) == []
    on_device = dataclasses.replace(both, host_splits=False)
    reasons = backend.check(on_device)
    assert [r.code for r in reasons] == ["layout"] and "host splits" in reasons[0].message


def test_priority_per_arch():
    backend = HipMxfp8Backend()
    for arch, expected in (("sm_90", 30), ("sm_89", 30), ("gfx950", 10)):
        problem = gg.describe_problem(groups=2, m=2 * 256, n=64, k=64, recipe="mxfp8", device=arch)
        assert backend.priority(problem) == expected


@pytest.mark.parametrize("op", ["fwd", "dgrad"])
def test_small_groups_rank_above_triton_mxfp8_on_sm_90(op):
    """17-128 rows a group on average, weights quantized in the call or pre-quantized: first
    on sm_90, where it timed faster than triton_mxfp8; not for decode, wgrad, larger groups
    or another arch."""
    backend = HipMxfp8Backend()
    triton_first = TritonMxfp8Backend.spec.priority
    small = gg.describe_problem(op=op, groups=128, m=128 * 128, n=256, k=256, recipe="mxfp8", device="sm_90")
    assert backend.priority(small) == hip_backend.SMALL_GROUPS_PRIORITY > triton_first
    assert backend.priority(dataclasses.replace(small, m=128 * 128 + 1)) == 30
    assert backend.priority(dataclasses.replace(small, m=128 * 16)) == 30  # decode: triton_mxfp8 as fast
    assert backend.priority(dataclasses.replace(small, m=128 * 16 + 1)) == hip_backend.SMALL_GROUPS_PRIORITY
    assert backend.priority(dataclasses.replace(small, op="wgrad")) == 30
    assert backend.priority(dataclasses.replace(small, b_format="mx_e4m3")) == hip_backend.SMALL_GROUPS_PRIORITY
    for arch in ("sm_89", "gfx950"):
        described = gg.describe_problem(op=op, groups=128, m=128 * 64, n=256, k=256, recipe="mxfp8", device=arch)
        assert backend.priority(described) < triton_first


def test_gfx942_refused_for_fnuz(cache):
    reasons = _reasons("gfx942", m=8 * 256, n=512, k=512)
    assert [r.code for r in reasons] == ["arch"] and "FNUZ" in reasons[0].message


def test_gfx950_declares_the_hipkittens_contract(cache):
    def messages(**kw) -> list[str]:
        return [str(r) for r in _reasons("gfx950", **kw) if r.code != "build"]

    bad = messages(op="fwd", groups=513, m=513 * 256, n=200, k=160)
    assert any("G=513 exceeds" in m for m in bad)
    assert any("N=200 is not a multiple of 256" in m for m in bad)
    assert any("K=160 is not a multiple of 128" in m for m in bad)
    assert any("K=160 (the contraction) is below 256" in m for m in bad)
    # dgrad contracts over N: N % 128, N >= 256, K (its output columns) % 256.
    bad = messages(op="dgrad", m=8 * 256, n=384, k=384)
    assert any("K=384 is not a multiple of 256" in m for m in bad)
    assert not any("N=384" in m for m in bad)
    bad = messages(op="wgrad", m=8 * 128, n=256, k=384)
    assert any("K=384 is not a multiple of 256" in m for m in bad)
    assert any("multiple of 128" in m for m in messages(op="wgrad", m=8 * 100, n=256, k=256))
    assert any("multiple of 256" in m for m in messages(m=8 * 256, n=256, k=256, device_splits=True))
    assert any("multiple of 256" in m for m in messages(m=8 * 200, n=256, k=256))
    # Problem.m_align is capped at the largest m_multiple any backend declares (1 today),
    # so even 256-row groups are refused on gfx950: conservative, never out of contract.
    assert any("multiples of 1 only" in m for m in messages(m=8 * 256, n=256, k=256))


_NVCC = shutil.which("nvcc")
_CUOBJDUMP = shutil.which("cuobjdump") or next(
    (str(p) for p in Path(sys.prefix).glob("lib/python3*/site-packages/triton/backends/nvidia/bin/cuobjdump")), None
)


def _spills_by_kernel(ptxas_log: str) -> dict[str, int]:
    """Bytes of spill stores per entry function, from ``ptxas -v``'s log."""
    spills, name = {}, None
    for line in ptxas_log.splitlines():
        entry = re.search(r"entry function '(\w+)'", line)
        if entry:
            name = entry.group(1)
        stores = re.search(r"(\d+) bytes spill stores", line)
        if stores and name:
            spills[name] = int(stores.group(1))
            name = None
    return spills


def _mma_loop_bodies(function_sass: str) -> list[list[str]]:
    """The lines, in order, of each innermost loop that issues MMAs (wgmma, mma.sync f16 or
    fp8; a loop: the range from a backward branch's target to the branch) of one
    function's SASS: its main loops, not the column passes around them."""
    address = re.compile(r"/\*([0-9a-f]{4,})\*/")
    code = [(int(m.group(1), 16), line) for line in function_sass.splitlines() if (m := address.search(line))]
    loops = []
    for at, line in code:
        branch = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", line)
        target = int(branch.group(1), 16) if branch else at
        if target < at:  # a backward branch: the loop [target, at]
            body = [text for where, text in code if target <= where <= at]
            if any(re.search(r"\b(HGMMA|HMMA|QMMA)\.", text) for text in body):
                loops.append((target, at, body))
    return [
        body
        for lo, hi, body in loops
        if not any(lo <= o_lo and o_hi <= hi and (o_lo, o_hi) != (lo, hi) for o_lo, o_hi, _ in loops)
    ]


def _local_accesses_in_mma_loops(function_sass: str) -> list[str]:
    """LDL / STL lines inside an innermost loop that issues MMAs (``_mma_loop_bodies``)."""
    return [text for body in _mma_loop_bodies(function_sass) for text in body if re.search(r"\b(LDL|STL)\b", text)]


def _register_written(line: str) -> str | None:
    """The register a SASS instruction writes first (its destination), None for stores,
    branches, barriers and MMAs."""
    parts = re.sub(r"^\s*/\*[0-9a-f]+\*/\s*(@!?U?P\w+\s+)?", "", line).split(";")[0].split()
    if len(parts) < 2 or re.match(r"(ST|BRA|BAR|WARPGROUP|HGMMA|RED|ATOM|SYNCS|UTMA|LDGSTS|DEPBAR)", parts[0]):
        return None
    return parts[1].rstrip(",")


def _register_a_overwritten_in_flight(function_sass: str) -> list[str]:
    """Instructions that write an A register of a register-sourced HGMMA before its group
    has retired. In a main loop (``_mma_loop_bodies``) groups are runs of HGMMAs, each
    followed by ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` (one group left in flight): an HGMMA's
    A registers are read until the DEPBAR after the next group, through the back edge for
    the loop's last group."""
    hgmma = re.compile(r"HGMMA\.\S+ R\d+, R(\d+),")
    found = []
    for body in _mma_loop_bodies(function_sass):
        groups, current = [], []
        for i, line in enumerate(body):
            if hgmma.search(line):
                current.append(i)
            elif "WARPGROUP.DEPBAR" in line and current:
                groups.append((current, i))
                current = []
        for j, (members, _) in enumerate(groups):
            retired = groups[(j + 1) % len(groups)][1]
            for issue in members:
                registers = {f"R{int(hgmma.search(body[issue]).group(1)) + r}" for r in range(4)}
                after = (
                    range(issue + 1, retired) if retired > issue else [*range(issue + 1, len(body)), *range(retired)]
                )
                found += [body[i].strip() for i in after if _register_written(body[i]) in registers]
    return found


#: (target, -D defines, an instruction its SASS must hold) of each compile check.
_SASS_CHECKS = [
    ("sm_89", [], r"QMMA\.16832\.F32\.E4M3\.E4M3"),  # native fp8 mma.sync
    ("sm_90a", [], r"HGMMA\.64x256x16\.F32"),  # the prescaled path on wgmma, fwd / dgrad's A from registers
    ("sm_90a", ["-DGG_MXFP8_REG_A=0"], r"HGMMA\.64x256x16\.F32"),  # fwd / dgrad's A from shared memory
    ("sm_90a", ["-DGG_MXFP8_WGMMA=0"], r"F2FP\.F16\.E4M3\.UNPACK_B"),  # ptxas: e4m3 -> f16, then HMMA.16816
    ("sm_90a", ["-DGG_MXFP8_PORTABLE"], r"FFMA"),  # the ROCm inner product, compiled for CUDA
]


def _compile_unit(directory: Path, target: str, defines: list[str]) -> tuple[subprocess.CompletedProcess, str]:
    """nvcc's result (``ptxas -v``'s log on stderr) and the SASS of one translation unit
    holding every kernel instantiation the binding launches, for ``target`` with ``defines``.
    ``-cubin`` compiles the device code exactly as ``-c`` does (the same cicc and ptxas runs,
    the same SASS and ptxas log), without the host compile nothing here reads."""
    directory.mkdir(parents=True)
    unit = directory / "unit.cu"
    maps = "const __grid_constant__ gg_mxfp8::TensorMap, const __grid_constant__ gg_mxfp8::TensorMap"
    rows = (
        "gg_mxfp8::Operand, gg_mxfp8::Operand, const int32_t*, const int32_t*, int, int, int64_t, "
        "const uint16_t*, const uint16_t*, {out}*, " + maps
    )
    wgrad = (
        "gg_mxfp8::Operand, gg_mxfp8::Operand, const int32_t*, int, int, const uint16_t*, const uint16_t*, {out}*, "
        "bool, " + maps
    )
    kernels = "\n".join(  # every instantiation the binding launches: out dtype x k-outer
        f"template __global__ void gg_mxfp8::{name}<{out}, {k_outer}>({params.format(out=out)});"
        for name, params in (("rows_kernel", rows), ("wgrad_kernel", wgrad))
        for out in ("float", "uint16_t")
        for k_outer in ("false", "true")
    )
    unit.write_text(f'#include "mxfp8_grouped.cuh"\n{kernels}\n')
    arch = target.removeprefix("sm_")
    compiled = subprocess.run(
        [_NVCC, "-std=c++17", "-O3", f"-I{build.CSRC}", f"-gencode=arch=compute_{arch},code={target}", "-Xptxas",
         "-v", *defines, "-cubin", str(unit), "-o", str(directory / "unit.cubin")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if compiled.returncode != 0:
        return compiled, ""
    sass = subprocess.run(
        [_CUOBJDUMP, "--dump-sass", str(directory / "unit.cubin")], capture_output=True, text=True, check=True
    ).stdout
    return compiled, sass


@pytest.fixture(scope="module")
def sass_compiles(request, tmp_path_factory):
    """``(target, defines) -> future of _compile_unit's result`` for every compile check this
    session runs, all started at once, one nvcc a core, the longest (the portable build,
    most of the time) first: the compiles are independent processes, and one at a time left
    the second core idle for the two and a half minutes they take. Each compile is the one
    its test ran itself before."""
    chosen = [
        (item.callspec.params["target"], item.callspec.params["defines"])
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_kernel_compiles_with_spills_only_in_wgrad"
    ]
    chosen.sort(key=lambda check: "-DGG_MXFP8_PORTABLE" not in check[1])
    root = tmp_path_factory.mktemp("sass")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        yield {
            (target, tuple(defines)): pool.submit(_compile_unit, root / str(i), target, defines)
            for i, (target, defines) in enumerate(chosen)
        }


@pytest.mark.skipif(not (_NVCC and _CUOBJDUMP), reason="needs nvcc and cuobjdump")
@pytest.mark.parametrize(("target", "defines", "instruction"), _SASS_CHECKS)
@pytest.mark.slow
def test_kernel_compiles_with_spills_only_in_wgrad(sass_compiles, target, defines, instruction):
    compiled, sass = sass_compiles[target, tuple(defines)].result()
    assert compiled.returncode == 0, compiled.stderr
    # The rows kernels and row_ranges_kernel keep their main loops' values in registers: at
    # 255 registers ptxas may keep up to four words of the epilogue's addresses in local
    # memory across the per-block path (stored once, loaded once a column pass), never in a
    # main loop (an innermost loop of MMAs). The wgrad kernels run two blocks a SM, at 128
    # registers a thread, and spill a few hundred bytes (loop-invariant loader state,
    # reloaded from L1): two blocks measured 1-13 % faster on seven of the nine cases on an
    # H100 despite them (docs/performance.md).
    spills = _spills_by_kernel(compiled.stderr)
    assert len(spills) == 9, compiled.stderr
    for name, spilled in spills.items():
        assert spilled <= (512 if "wgrad_kernel" in name else 16), (name, spilled)
    assert re.search(instruction, sass)
    for function in re.split(r"\bFunction : ", sass)[1:]:
        name = function.split("\n", 1)[0]
        if "wgrad_kernel" not in name:
            assert not _local_accesses_in_mma_loops(function), name
            if "rows_kernel" not in name:
                assert not re.search(r"\b(LDL|STL)\b", function), name
    if target == "sm_90a" and defines in ([], ["-DGG_MXFP8_REG_A=0"]):
        # Two halves of a stage, four k16 steps each, in each of the eight kernels: 256 columns
        # for fwd / dgrad, 128 for wgrad; ptxas did not have to serialize them (it warns when
        # accumulators are touched in flight).
        assert len(re.findall(r"\bHGMMA\.64x256x16\b", sass)) == 4 * 2 * 4
        assert len(re.findall(r"\bHGMMA\.64x128x16\b", sass)) == 4 * 2 * 4
        assert "serializ" not in compiled.stderr, compiled.stderr
        assert "HMMA.16816.F32" in sass and "LDGSTS" in sass  # the per-block path
        assert "UTMALDG.2D" in sass  # the wgmma path's stages, copied by TMA
    if target == "sm_90a" and defines == []:
        # wgmma reads register A asynchronously: nothing may write it until its group retires.
        rows = [f for f in re.split(r"\bFunction : ", sass)[1:] if "rows_kernel" in f.split("\n", 1)[0]]
        assert len(rows) == 4 and all(re.search(r"HGMMA\.64x256x16\.F32\S* R\d+, R\d+,", f) for f in rows)
        for function in rows:
            assert not _register_a_overwritten_in_flight(function), function.split("\n", 1)[0]
    if defines == ["-DGG_MXFP8_WGMMA=0"]:
        assert "HMMA.16816.F32" in sass
        # On both paths each E4M3 fragment register is converted once (two F2FP) and feeds
        # every f16 MMA of the warp tile: per MX block 16 A and 8 B registers, 32 HMMA. Per
        # MMA, as the microbenchmark's lone instruction is, it would be 12 F2FP for every 2.
        assert len(re.findall(r"\bF2FP\.F16\.E4M3\b", sass)) * 2 == len(re.findall(r"\bHMMA\b", sass)) * 3
        # The prescaled path multiplies each converted pair by its relative scale once.
        assert "HMUL2" in sass
        # Fragments come from shared memory by ldmatrix (one a row fragment, one for two
        # column fragments) and the stages by asynchronous copies.
        assert len(re.findall(r"\bLDSM\b", sass)) * 32 == len(re.findall(r"\bHMMA\b", sass)) * 6
        assert "LDGSTS" in sass


@pytest.mark.parametrize("builds", [True, False])
def test_the_build_waits_for_prepare(cache, monkeypatch, builds):
    """On this machine's GPU (emulated: a compiler present, nothing built yet) ``check`` does
    not build: every mxfp8 decision asks it, also those ``triton_mxfp8`` wins. ``prepare`` does,
    once this backend is about to run, and a failed build makes it ineligible there."""
    monkeypatch.setattr(build, "blocker", lambda vendor: None)
    attempts = []

    def ensure(arch, vendor):
        attempts.append(arch)
        outcome = build.BuildResult(
            arch,
            cache / "build.log",
            module=object() if builds else None,
            error=None if builds else "build failed: nvcc",
        )
        monkeypatch.setattr(build, "result", lambda a: outcome)
        return outcome

    monkeypatch.setattr(build, "ensure", ensure)
    monkeypatch.setattr(build, "result", lambda arch: None)
    described = gg.describe_problem(op="fwd", recipe="mxfp8", groups=8, m=4096, n=1024, k=1024, device="sm_90")
    here = dataclasses.replace(described, device=dataclasses.replace(described.device, detected=True), placement="cuda")
    backend = HipMxfp8Backend()
    assert backend.check(here) == [] and attempts == []
    reasons = backend.prepare(here)
    assert attempts == ["sm_90"]
    assert [r.code for r in reasons] == ([] if builds else ["build"])
    # Known now: answered again without a second build (another thread's failure included).
    assert [r.code for r in backend.prepare(here)] == ([] if builds else ["build"]) and attempts == ["sm_90"]
    assert [r.code for r in backend.check(here)] == ([] if builds else ["build"])
    assert backend.prepare(described) == [] and attempts == ["sm_90"]  # a described device is built where it runs


def _decoded(data: torch.Tensor, scale: torch.Tensor, block_axis: int) -> torch.Tensor:
    """E4M3 codes times their E8M0 block scales (byte 255: NaN), in float64."""
    return data.double() * decode_scales(scale).double().repeat_interleave(32, dim=block_axis)


class _KernelModel:
    """Stands in for the compiled module on the CPU: computes what the kernels compute from
    the operands exactly as the backend hands them over, reading each in the layout its
    ``k_outer`` flag declares, so a layout the Python side gets wrong gives a wrong result."""

    def __init__(self) -> None:
        self.k_outer: list[bool] = []

    def rows_gemm(self, a_data, a_scale, b_data, b_scale, row_ends, tile_ends, max_tiles, out, k_outer):
        self.k_outer.append(k_outer)
        a = _decoded(a_data, a_scale, 1)
        b = _decoded(b_data, b_scale, 1 if k_outer else 2)
        b = b.transpose(1, 2) if k_outer else b  # (G, C, L)
        start = 0
        for g, end in enumerate(row_ends.tolist()):
            out[start:end] = (a[start:end] @ b[g].T).to(out.dtype)
            start = end

    def wgrad_gemm(self, a_data, a_scale, b_data, b_scale, pad_ends, out, accumulate, k_outer):
        self.k_outer.append(k_outer)
        a = _decoded(a_data, a_scale, 0 if k_outer else 1)
        b = _decoded(b_data, b_scale, 0 if k_outer else 1)
        a, b = (a.T, b.T) if k_outer else (a, b)  # (R, T), (C, T)
        start = 0
        for g, end in enumerate(pad_ends.tolist()):
            out[g] = (out[g] if accumulate else 0) + (a[:, start:end] @ b[:, start:end].T).to(out.dtype)
            start = end


@pytest.mark.parametrize(
    ("op", "k", "n", "k_outer"),
    [
        ("dgrad", 160, 96, True),  # K (dgrad's output columns) whole 16-byte lines: read as quantized
        ("dgrad", 136, 96, False),  # K % 16 == 8: transposed by a copy first
        ("wgrad", 160, 96, True),
        ("wgrad", 160, 72, False),  # N % 16 == 8
        ("fwd", 136, 72, False),
    ],
)
def test_operand_layouts_handed_to_the_kernels(op, k, n, k_outer):
    """The backend's choice between reading a k-outer operand as it is and transposing it
    first, checked on the CPU against ``reference`` through a model of the kernels."""
    gen = torch.Generator().manual_seed(0)
    groups, m, splits = 3, 100, [40, 0, 60]
    problem = gg.describe_problem(op=op, recipe="mxfp8", groups=groups, m=m, n=n, k=k, device="sm_90", splits=splits)
    problem = dataclasses.replace(problem, out_dtype="float32")
    shapes = {"fwd": ((m, k), (groups, n, k)), "dgrad": ((m, n), (groups, n, k)), "wgrad": ((m, n), (m, k))}[op]
    a, b = (torch.randn(*shape, generator=gen) for shape in shapes)
    model = _KernelModel()
    run = hip_backend._run_wgrad if op == "wgrad" else hip_backend._run_rows
    got = run(model, problem, gg.GroupedInputs(a, b, tuple(splits)))
    call = {"fwd": gg.grouped_gemm, "dgrad": gg.grouped_gemm_dgrad, "wgrad": gg.grouped_gemm_wgrad}[op]
    want = call(a, b, splits, recipe="mxfp8", out_dtype=torch.float32, backend="reference")
    assert model.k_outer == [k_outer]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
