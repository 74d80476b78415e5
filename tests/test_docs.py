"""The Python blocks of README.md and docs/ that are marked to run do run, pasted as they are."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from forked_runs import run_forked

from grouped_gemm.device import known_archs

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- runs in tests/test_docs.py -->"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _marked_blocks() -> list[tuple[str, str]]:
    blocks = []
    for path in DOCS:
        text = path.read_text()
        for i, code in enumerate(re.findall(re.escape(MARK) + r"\n```python\n(.*?)\n```", text, re.S)):
            blocks.append((f"{path.relative_to(ROOT)}#{i}", code))
    return blocks


BLOCKS = _marked_blocks()


def test_the_marked_blocks_are_found():
    """README's plugin example and docs/module.md's GroupedLinear block at least."""
    found = {name.split("#")[0] for name, _ in BLOCKS}
    assert {"README.md", "docs/module.md"} <= found


@pytest.fixture(scope="module")
def block_runs() -> dict[str, tuple[int, str, str]]:
    """Each marked block run as ``python -c <block>`` from the repository root: (exit status,
    stdout, stderr) by name, each in a child of one process that imported torch and
    grouped_gemm (every block's first two lines) once, instead of a fresh Python each."""
    programs = {name: ["-c", code] for name, code in BLOCKS}
    return run_forked(programs, ["torch", "grouped_gemm"], env=os.environ, cwd=ROOT, timeout=300)


@pytest.mark.parametrize("name,code", BLOCKS, ids=[name for name, _ in BLOCKS])
def test_marked_block_runs(name, code, block_runs):
    status, stdout, stderr = block_runs[name]
    assert status == 0, f"{name} failed:\n{stderr}"
    for expected in re.findall(r"print\(.*\)\s+# (\S+)$", code, re.M):
        assert expected in stdout.split(), (name, expected, stdout)


def test_readme_lists_the_known_archs():
    text = (ROOT / "README.md").read_text()
    listed = re.search(r"`archs` are patterns \(`fnmatch`\) of\s+arch names: (.*?) \(", text, re.S).group(1)
    assert set(re.findall(r"`([a-z0-9_]+)`", listed)) == set(known_archs())
