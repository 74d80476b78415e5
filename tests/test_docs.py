"""The Python blocks of README.md and docs/ that are marked to run do run, pasted as they are."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("name,code", BLOCKS, ids=[name for name, _ in BLOCKS])
def test_marked_block_runs(name, code):
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stderr}"
    for expected in re.findall(r"print\(.*\)\s+# (\S+)$", code, re.M):
        assert expected in proc.stdout.split(), (name, expected, proc.stdout)


def test_readme_lists_the_known_archs():
    text = (ROOT / "README.md").read_text()
    listed = re.search(r"`archs` are patterns \(`fnmatch`\) of\s+arch names: (.*?) \(", text, re.S).group(1)
    assert set(re.findall(r"`([a-z0-9_]+)`", listed)) == set(known_archs())
