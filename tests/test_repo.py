"""Repository promises: CI runs the README's test command, and nothing generic is importable."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(python3 -m venv .+?)\n```", text)


def test_ci_runs_the_readme_test_command():
    demo, tests = _readme_commands()
    assert demo.endswith("python examples/quickstart.py")
    assert tests.endswith("&& pytest")
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


def _declared(name: str) -> Requirement:
    """The requirement on ``name`` that the installed distribution declares (pip's view of pyproject)."""
    for line in metadata.requires("moe-grouped-gemm") or []:
        req = Requirement(line)
        if req.name == name and req.marker is None:
            return req
    raise AssertionError(f"moe-grouped-gemm declares no requirement on {name}")


def test_readme_torch_pin_is_inside_the_declared_range():
    for command in _readme_commands():
        pins = re.findall(r"pip install torch==(\S+)", command)
        assert pins, command
        assert all(Version(pin) in _declared("torch").specifier for pin in pins)


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_installed_versions_are_inside_the_declared_range(name):
    installed = Version(metadata.version(name))
    assert Version(installed.base_version) in _declared(name).specifier, (name, str(installed))


def test_readme_pins_no_triton():
    """torch pins its own Triton (2.13 -> 3.7.1 on PyPI); a second pin in the README conflicts with it."""
    assert not any("triton==" in command for command in _readme_commands())


def test_built_in_backends_live_under_the_package_name():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"grouped_gemm.backends" = "backends"' in pyproject
    packages = re.search(r"packages = \[(.*?)\]", pyproject, re.S).group(1)
    assert all(p.strip().strip('"').startswith("grouped_gemm") for p in packages.split(",") if p.strip())


def test_docs_cite_repository_paths_not_machine_paths():
    """A reader has the repository, not the machine a document was written on."""
    texts = [ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("examples/*.py")]
    machine_path = re.compile(r"`(/(?:work|home|tmp|root)/[^`]*)`")
    cited = {p.relative_to(ROOT).as_posix(): machine_path.findall(p.read_text()) for p in texts}
    assert not {path: found for path, found in cited.items() if found}


def test_readme_lists_the_triton_releases_ci_runs():
    """The 'Tested versions' table names exactly the releases .ci/run hands to .ci/triton-matrix."""
    run = (ROOT / ".ci" / "run").read_text()
    ci = set(re.search(r"^bash \.ci/triton-matrix (.+)$", run, re.M).group(1).split())
    table = re.findall(
        r"^\| [^|]+ \| (\d+\.\d+\.\d+)[^|]*\| CPU, CI `\.ci/triton-matrix`", (ROOT / "README.md").read_text(), re.M
    )
    assert ci and set(table) == ci
