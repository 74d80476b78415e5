"""Warn when another distribution installs the ``grouped_gemm`` import name too.

The Megatron-style ``grouped_gemm`` distribution (PyPI name ``grouped_gemm``) ships a
package of the same import name. Both in one environment means one overwrote the other's
files and pip uninstalling either breaks the one left, so it is said once, at import.
"""

from __future__ import annotations

import warnings
from importlib import metadata

#: This project's distribution name (pyproject ``[project] name``).
OWN_DISTRIBUTION = "moe-grouped-gemm"
_MARKER = "grouped_gemm/__init__.py"


class NameClashWarning(UserWarning):
    """Another installed distribution also provides the ``grouped_gemm`` package."""


def _normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _provides_package(dist: metadata.Distribution) -> bool:
    # RECORD (wheels) is searched as text: parsing every distribution's file list (torch's
    # runs to thousands of entries) would cost a noticeable share of the import.
    record = dist.read_text("RECORD")
    if record is not None:
        return f"\n{_MARKER}," in f"\n{record}"
    return any(str(path).replace("\\", "/") == _MARKER for path in dist.files or ())


def clashing_distributions() -> list[str]:
    """Names of the installed distributions other than this one that install ``grouped_gemm/__init__.py``."""
    names = {
        dist.metadata["Name"]
        for dist in metadata.distributions()
        if dist.metadata["Name"] and _normalize(dist.metadata["Name"]) != OWN_DISTRIBUTION
        if _provides_package(dist)
    }
    return sorted(names)


def warn_if_clashing() -> None:
    """Emit one NameClashWarning naming the other distributions, if there are any."""
    others = clashing_distributions()
    if not others:
        return
    warnings.warn(
        f"grouped_gemm: the import name 'grouped_gemm' is also installed by {', '.join(others)} "
        f"(besides {OWN_DISTRIBUTION}); one overwrote the other's files. Keep one: "
        f"'pip uninstall {' '.join(others)}', then reinstall {OWN_DISTRIBUTION} with 'pip install --force-reinstall'. "
        "Code written for the Megatron-style package's gmm runs on grouped_gemm.ops.gmm (docs/module.md).",
        NameClashWarning,
        stacklevel=3,
    )
