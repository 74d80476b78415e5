"""Entry-point plugins installed into a scratch directory, and child Pythons that see it:
the tests of plugin loading run there, so a plugin never leaks into the test process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path


def install_plugin(site: Path, dist: str, modules: Mapping[str, str], entries: Mapping[str, str] | None = None) -> None:
    """Install distribution ``dist`` into ``site``: each module's (dedented) source and
    ``grouped_gemm`` entry points, name -> module (default: each module under its name)."""
    for module, source in modules.items():
        (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    points = entries if entries is not None else {module: module for module in modules}
    (info / "entry_points.txt").write_text("[grouped_gemm]\n" + "".join(f"{n} = {m}\n" for n, m in points.items()))


def with_import_path(*dirs: Path | str, **extra: str) -> dict[str, str]:
    """``os.environ`` with ``dirs`` put before the inherited ``PYTHONPATH``: replacing it
    hid whatever the parent imports through it (pydantic on the GPU image), and every
    child failed at ``import grouped_gemm``."""
    inherited = os.environ.get("PYTHONPATH", "")
    path = os.pathsep.join([*map(str, dirs), *([inherited] if inherited else [])])
    return {**os.environ, "PYTHONPATH": path, **extra}


def run_python(site: Path, code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` (dedented) run by a child Python that imports from ``site`` first."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=with_import_path(site, **env),
        timeout=120,
    )
