"""The sm_90 / sm_100 / gfx950 compile checks of the Triton MX kernels, on every Triton CI runs.

``benchmarks/triton_mx_compile.py`` compiles the kernels for each target on the CPU (Triton
ships ptxas and the AMD linker) and checks the code: wgmma with the upcast weight in
registers and nothing of it through shared memory, a pipelined contraction loop, the MX
block-scaled MMA instructions on sm_100 and gfx950. A layout decision of Triton's that
sends the decoded weight through shared memory costs no accuracy, only speed (the E4M3
decode ran at half speed that way, unseen, until the check counted ``STSM``:
docs/performance.md), so only this test catches it. It runs the script in a subprocess
with the interpreter off, under whichever Triton is first on the path (CI's matrix).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[1]
#: Triton releases from which the 8-warp upcast tiles convert the decoded weight through
#: shared memory (seen with 3.9 on 2026-12-04; 3.6 and 3.7.1 do not): a speed regression
#: the notes record (docs/notes/triton_mxfp4.md), tolerated here for exactly those rows.
ROUND_TRIP_FROM = (3, 8)


def _version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


#: Compiles, into the Triton cache of the environment it runs in, the kernels the script
#: argv[1] compiles, last first: it runs the script's ``main`` with ``_compile`` recording its
#: arguments instead of compiling (and ``_cuobjdump`` answering for the empty stand-ins it
#: returns), then calls the real ``_compile`` with them in reverse order. Started beside the
#: script, it takes the second half of the list while the script works through the first,
#: and the script finds those kernels in the cache: the same compile (Triton's cache key is
#: the source, signature, constants, target, options, Triton version and environment) and
#: the same CompiledKernel (a fresh compile is also read back from the cache's files).
_FROM_THE_END = textwrap.dedent(
    """
    import collections, importlib.util, os, sys, types

    os.nice(10)  # never ahead of the script itself for a core
    spec = importlib.util.spec_from_file_location("triton_mx_compile", sys.argv[1])
    script = sys.modules["triton_mx_compile"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    compile_, calls = script._compile, []

    class Compiled:  # what the script reads of a compiled kernel, empty
        asm = collections.defaultdict(str)
        metadata = types.SimpleNamespace(shared=0, num_warps=0)

    script._compile = lambda *args, **kwargs: calls.append((args, kwargs)) or Compiled()
    script._cuobjdump = lambda cubin, flag: "REG:0 STACK:0 SHARED:0 LOCAL:0"
    sys.argv = sys.argv[1:]
    try:
        script.main()
    except SystemExit:  # the empty stand-ins fail every check
        pass
    for args, kwargs in reversed(calls):
        compile_(*args, **kwargs)
    """
)


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("compile")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(out / "cache")
    script = ROOT / "benchmarks" / "triton_mx_compile.py"
    # The compiles take most of a minute on one core: where there is another, a helper
    # compiles from the end of the list there, and is stopped when the script is done (its
    # output is not read; if it fails, the script compiles everything itself, as before).
    helpers = []
    if len(os.sched_getaffinity(0)) > 1:
        helpers.append(
            subprocess.Popen(
                [sys.executable, "-c", _FROM_THE_END, str(script)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    try:
        done = subprocess.run(
            [sys.executable, str(script), "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True
        )
    finally:
        for helper in helpers:
            helper.kill()
            helper.wait()
    report = out / "triton_mx_compile.json"
    assert report.exists(), done.stdout[-2000:] + done.stderr[-4000:]
    found = json.loads(report.read_text())
    assert found["triton"] == triton.__version__
    return found["rows"]


def test_every_target_and_kernel_is_checked(rows):
    targets = {r["target"] for r in rows}
    assert targets == {"sm_90", "sm_100", "gfx950"}
    names = " ".join(r["kernel"] for r in rows if r["target"] == "sm_90")
    assert "upcast e4m3" in names and "upcast e2m1" in names and "wgrad bf16" in names


def test_compute_bound_defaults_are_checked_with_tma(rows):
    """The default tiles above 64 rows a group fetch the activations through tensor
    descriptors (the script takes them from ``launch.py``'s defaults): both formats' are
    compiled so, and copy by TMA without spills."""
    tma = [r for r in rows if r["kernel"].startswith("upcast") and " TMA " in r["kernel"]]
    assert {r["kernel"].split()[1] for r in tma} == {"e2m1", "e4m3"}, [r["kernel"] for r in tma]
    assert all(r["pipeline"]["ptx_bulk_tensor"] > 0 and r["spills"] == 0 for r in tma), tma


def test_compiled_code_is_as_designed(rows):
    """Every row passes; from ``ROUND_TRIP_FROM`` on, 8-warp upcast tiles may fail only by
    stores to shared memory in the loop (still wgmma, still pipelined, TMA rows' bulk copies
    included, and no spills: the TMA rows' own check)."""
    tolerated = _version() >= ROUND_TRIP_FROM
    for r in rows:
        if r["ok"]:
            continue
        round_trip_only = (
            r["target"] == "sm_90"
            and r["kernel"].startswith("upcast")
            and r["warps"] == 8
            and r["counts"]["HGMMA"] > 0
            and r["pipeline"]["ok"]
            and r["spills"] == 0
        )
        assert tolerated and round_trip_only, f"Triton {triton.__version__}: {r['kernel']} on {r['target']}: {r}"


def test_4_warp_upcast_tiles_never_round_trip(rows):
    """The decode tiles (4 warps) keep the weight in registers under every Triton."""
    small = [r for r in rows if r["kernel"].startswith("upcast") and r["warps"] == 4]
    assert small and all(r["counts"]["STS"] + r["counts"]["STSM"] == 0 for r in small)


def test_quantizing_decode_tiles_store_only_their_activations(rows):
    """The decode tiles that quantize their bf16 activations (``launch_upcast(quantize=...)``)
    store only the quantized slab to shared memory for wgmma's right operand, two 16-byte
    stores a thread per 16 rows (the weight stays in registers: no ``STSM``), and spill
    nothing, in both formats."""
    fused = [r for r in rows if r["kernel"].startswith("quantizing upcast")]
    assert {r["kernel"].split()[2] for r in fused} == {"e2m1", "e4m3"}, [r["kernel"] for r in fused]
    for r in fused:
        rows_high = int(r["kernel"].split("BM=")[1].split()[0])
        assert r["counts"]["STSM"] == 0 and 0 < r["counts"]["STS"] <= rows_high // 8 and r["spills"] == 0, r


def test_four_block_e2m1_words_copy_in_16_byte_pieces(rows):
    """At four blocks a step the E2M1 words of a (row, q) are one 16-byte copy; a step
    offset Triton cannot see is a multiple of four made them four 4-byte copies and the
    16-row decode tile issued 19 copies a step instead of 7 (Triton 3.6)."""
    four = [r for r in rows if r["kernel"].startswith("upcast e2m1") and "BLOCKS=4" in r["kernel"]]
    # The row scales' copies (the script's _narrow_copies_max): one a thread on 4 warps, two on 8.
    assert four and all(r["counts"]["narrow_copies"] <= (1 if r["warps"] == 4 else 2) for r in four), four
