"""Repository promises: CI runs the README's test command, and nothing generic is importable."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(python3 -m venv .+?)\n```", text)


def test_ci_runs_the_readme_test_command():
    demo, tests = _readme_commands()
    assert demo.endswith("python examples/quickstart.py")
    assert tests.endswith("&& pytest")
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


def test_built_in_backends_live_under_the_package_name():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"grouped_gemm.backends" = "backends"' in pyproject
    packages = re.search(r"packages = \[(.*?)\]", pyproject, re.S).group(1)
    assert all(p.strip().strip('"').startswith("grouped_gemm") for p in packages.split(",") if p.strip())
