"""The layering in pyproject.toml's ``[tool.importlinter]`` holds (import-linter, in CI).

The built-in backends live in ``backends/`` but install as ``grouped_gemm.backends``; an
editable install maps them there with an import hook that import-linter cannot follow, so
the check runs on a copy laid out as a wheel installs it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from plugin_site import with_import_path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold(tmp_path):
    skip = shutil.ignore_patterns("__pycache__", "csrc")
    shutil.copytree(ROOT / "grouped_gemm", tmp_path / "grouped_gemm", ignore=skip)
    shutil.copytree(ROOT / "backends", tmp_path / "grouped_gemm" / "backends", ignore=skip)
    env = with_import_path(tmp_path)
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())",
            str(ROOT / "pyproject.toml"),
            "--no-cache",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
