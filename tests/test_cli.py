"""The command line: backends, explain, and python -m grouped_gemm."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_backends_lists_every_backend_with_support_and_availability(capsys):
    assert main(["backends"]) == 0
    text = capsys.readouterr().out
    assert "reference" in text and "plugin: grouped_gemm.backends.reference" in text
    assert "supports: ops dgrad,fwd,wgrad" in text
    assert "here: available" in text


def test_backends_for_a_described_arch(capsys):
    assert main(["backends", "--arch", "gfx950"]) == 0
    assert "gfx950" in capsys.readouterr().out


def test_explain_prints_the_decision_table(capsys):
    argv = ["explain", "--op", "fwd", "--recipe", "bf16", "--groups", "8", "--m", "4096", "--n", "4096"]
    assert main([*argv, "--k", "7168", "--skew", "--arch", "gfx950"]) == 0
    text = capsys.readouterr().out
    assert "fwd bf16 G=8 M=4096 N=4096 K=7168" in text
    assert "on gfx950" in text and "rank" in text and "selected:" in text


def test_explain_exit_code_when_nothing_can_run(capsys):
    argv = ["explain", "--recipe", "bf16", "-G", "2", "-M", "8", "-N", "8", "-K", "8", "--backend", "reference"]
    assert main([*argv]) == 0
    capsys.readouterr()
    assert main(["explain", "-G", "2", "-M", "8", "-N", "8", "-K", "8", "--backend", "ghost"]) == 2
    assert "ghost" in capsys.readouterr().err


def test_python_dash_m():
    proc = subprocess.run(
        [sys.executable, "-m", "grouped_gemm", "explain", "-G", "4", "-M", "64", "-N", "32", "-K", "32"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "selected:" in proc.stdout


def test_quickstart_runs_and_shows_the_decision():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "fwd   rel. error vs float64" in proc.stdout
    assert "selected:" in proc.stdout
    errors = [float(line.rsplit(" ", 1)[1]) for line in proc.stdout.splitlines() if "rel. error" in line]
    assert len(errors) == 3 and max(errors) < 1e-2
    if "Preferring" in proc.stdout:
        assert "FallbackWarning: grouped_gemm fallback" in proc.stderr


def test_bare_command_prints_help(capsys):
    assert main([]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: grouped-gemm") and "explain" in text and "``" not in text


def _lines_fit(text: str, width: int = 100) -> None:
    too_long = [line for line in text.splitlines() if len(line) > width]
    assert not too_long, too_long


def test_explain_wraps_and_explains_its_markers(capsys):
    argv = ["explain", "--op", "wgrad", "--recipe", "mxfp4", "-G", "4", "-M", "256", "-N", "64", "-K", "128"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    _lines_fit(text)
    assert "* = selected" in text and "prio = " in text and "so priority decides" in text


def test_explain_out_dtype_asks_about_fp32_main_grad(capsys):
    argv = ["explain", "--op", "wgrad", "-G", "4", "-M", "256", "-N", "64", "-K", "128", "--accumulate"]
    assert main([*argv, "--out-dtype", "float32"]) == 0
    assert "[bfloat16 x bfloat16 -> float32]" in capsys.readouterr().out


def test_backends_show_the_priority_for_the_device_and_fit(capsys):
    assert main(["backends"]) == 0
    here = capsys.readouterr().out
    _lines_fit(here)
    assert "torch_grouped_mm" in here and "(priority 5)" in here.split("torch_grouped_mm", 1)[1].splitlines()[0]
    assert main(["backends", "--arch", "sm_90"]) == 0
    gpu = capsys.readouterr().out
    assert "(priority 50)" in gpu.split("torch_grouped_mm", 1)[1].splitlines()[0]


@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize("recipe", ["bf16", "mxfp8", "mxfp4"])
def test_described_problem_is_the_real_calls_problem(op, recipe, gen):
    """explain without tensors must decide what the call with tensors decides (grad_format included)."""
    splits, n, k = [64, 0, 96, 32], 64, 128
    m = sum(splits)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(len(splits), n, k, generator=gen).bfloat16()
    dy = torch.randn(m, n, generator=gen).bfloat16()
    args = {"fwd": (x, w), "dgrad": (dy, w), "wgrad": (dy, x)}[op]
    real = gg.explain(*args, splits, op=op, recipe=recipe)
    described = gg.explain(op=op, recipe=recipe, groups=len(splits), m=m, n=n, k=k, splits=splits)
    assert described.problem == real.problem
    assert described.selected == real.selected
    if recipe == "mxfp4":
        assert described.candidate("triton_mxfp4").eligible


#: The commands of the test below, by parameter id.
_TRITON_ON_THE_CPU = {
    "argv0": ["check", "--backends", "triton_grouped", "--recipes", "bf16", "--ops", "fwd"],
    "argv1": [
        "bench",
        "--backends",
        "triton_grouped",
        "--cases",
        "mixtral_down",
        "--ops",
        "fwd",
        "--splits",
        "balanced",
    ],
}


@pytest.fixture(scope="module")
def triton_on_the_cpu(request, tmp_path_factory) -> Iterator[Callable[[str], tuple[int, str, str]]]:
    """``python -m grouped_gemm <argv> --device cpu --quiet`` without TRITON_INTERPRET for
    each of ``_TRITON_ON_THE_CPU`` this session runs (read from session.items, so a ``-k``
    pick starts only what it selects): (exit status, stdout, stderr) by id. They start at
    once (independent processes, one a core; each ran alone for ~10 s before); one still
    running at the end of the module is stopped."""
    chosen = {
        item.callspec.params["name"]
        for item in request.session.items
        if getattr(item, "originalname", None)
        == "test_check_and_bench_run_the_triton_backends_on_the_cpu_without_triton_interpret"
    }
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    quick = ["--rep-ms", "1", "--min-reps", "1", "--max-reps", "1", "--warmup-ms", "0", "--no-peer"]
    out = tmp_path_factory.mktemp("triton_on_the_cpu")
    started = {}
    for name, argv in _TRITON_ON_THE_CPU.items():
        if name not in chosen:
            continue
        extra = quick if argv[0] == "bench" else []
        logs = [(out / f"{name}.{stream}").open("w+") for stream in ("stdout", "stderr")]
        cmd = [sys.executable, "-m", "grouped_gemm", *argv, *extra, "--device", "cpu", "--quiet"]
        started[name] = (subprocess.Popen(cmd, stdout=logs[0], stderr=logs[1], text=True, env=env), logs)

    def result(name: str) -> tuple[int, str, str]:
        proc, (stdout, stderr) = started[name]
        proc.wait(timeout=300)
        stdout.seek(0)
        stderr.seek(0)
        return proc.returncode, stdout.read(), stderr.read()

    yield result
    for proc, logs in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for log in logs:
            log.close()


@pytest.mark.parametrize("name", list(_TRITON_ON_THE_CPU))
def test_check_and_bench_run_the_triton_backends_on_the_cpu_without_triton_interpret(name, triton_on_the_cpu):
    # The commands set TRITON_INTERPRET=1 themselves, after `import grouped_gemm` had imported
    # triton.language: its jit functions stayed compiled-only and every Triton run failed with
    # "Cannot call @triton.jit'd outside of the scope of a kernel" (exit status 1), or was
    # not eligible at all when the backends had loaded before (bench --backends).
    argv = _TRITON_ON_THE_CPU[name]
    returncode, stdout, stderr = triton_on_the_cpu(name)
    assert returncode == 0, stdout[-2000:] + stderr[-2000:]
    assert "Cannot call @triton.jit" not in stdout + stderr
    ran = [line.split()[-1] for line in stdout.splitlines() if "triton_grouped " in line]
    assert ran and set(ran) == {"pass" if argv[0] == "check" else "ok"}, stdout[-2000:]


def test_build_with_an_empty_backend_name_is_an_unknown_backend(capsys):
    # `grouped-gemm build "$BACKEND"` with the variable unset built every backend.
    assert main(["build", ""]) == 2
    assert "backend='' is invalid: registered backends are" in capsys.readouterr().err
