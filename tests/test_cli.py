"""The command line: backends, explain, and python -m grouped_gemm."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from grouped_gemm.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_backends_lists_every_backend_with_support_and_availability(capsys):
    assert main(["backends"]) == 0
    text = capsys.readouterr().out
    assert "reference" in text and "plugin grouped_gemm.backends.reference" in text
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
