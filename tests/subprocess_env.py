"""The environment of a child Python that sees extra import directories first."""

from __future__ import annotations

import os
from pathlib import Path


def with_import_path(*dirs: Path | str, **extra: str) -> dict[str, str]:
    """``os.environ`` with ``dirs`` put before the inherited ``PYTHONPATH``: replacing it
    hid whatever the parent imports through it (pydantic on the GPU image), and every
    child failed at ``import grouped_gemm``."""
    inherited = os.environ.get("PYTHONPATH", "")
    path = os.pathsep.join([*map(str, dirs), *([inherited] if inherited else [])])
    return {**os.environ, "PYTHONPATH": path, **extra}
