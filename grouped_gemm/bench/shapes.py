"""Benchmark cases: the MoE shapes of ``moe_shapes.json``, selected, scaled and split.

The JSON ships inside the package (``grouped_gemm/bench/moe_shapes.json``;
``benchmarks/moe_shapes.json`` links to it) so an installed ``grouped-gemm bench`` finds
the same cases as a checkout. Splits follow the file's "splits" rules through
``grouped_gemm.splits`` so every tool builds identical group sizes for a case.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from importlib import resources
from typing import Any

from grouped_gemm.errors import InvalidArgumentError
from grouped_gemm.splits import balanced_splits, skewed_splits

SPLIT_KINDS = ("balanced", "skewed")

#: Scaled N and K are rounded up to this multiple: the MX block size, so a scaled case
#: stays runnable by MX recipes, and a common alignment of kernel backends.
SCALED_DIM_MULTIPLE = 32


@dataclasses.dataclass(frozen=True)
class Case:
    """One forward-problem shape: x ``(M, K)`` in G groups, w ``(G, N, K)``."""

    name: str
    groups: int
    m: int
    n: int
    k: int

    def scaled(self, scale: float) -> Case:
        """The same case with M, N, K multiplied by ``scale`` (G kept), for smoke runs.

        M is rounded to the nearest integer (at least 1); N and K are rounded up to a
        multiple of ``SCALED_DIM_MULTIPLE``.
        """
        if scale == 1.0:
            return self

        def dim(value: int) -> int:
            return max(SCALED_DIM_MULTIPLE, math.ceil(value * scale / SCALED_DIM_MULTIPLE) * SCALED_DIM_MULTIPLE)

        return Case(self.name, self.groups, max(1, round(self.m * scale)), dim(self.n), dim(self.k))

    def with_rows_per_group(self, rows: int) -> Case:
        """The same experts with ``rows`` tokens per group on average (M = rows x G), named
        ``<name>@<rows>rpg``: where a backend's lead depends on the token count."""
        return Case(f"{self.name}@{rows}rpg", self.groups, rows * self.groups, self.n, self.k)

    def splits(self, kind: str) -> list[int]:
        """Group sizes by the shapes file's rule for ``kind`` (balanced or skewed, seed 0)."""
        if kind == "balanced":
            return balanced_splits(self.groups, self.m)
        if kind == "skewed":
            return skewed_splits(self.groups, self.m)
        raise InvalidArgumentError("splits", kind, f"one of {', '.join(SPLIT_KINDS)}")


@functools.cache
def shapes_document() -> dict[str, Any]:
    """The parsed ``moe_shapes.json`` shipped with the package."""
    text = resources.files("grouped_gemm.bench").joinpath("moe_shapes.json").read_text(encoding="utf-8")
    return json.loads(text)


def all_cases() -> tuple[Case, ...]:
    """Every case of the shapes file, in file order."""
    return tuple(Case(name=c["name"], groups=c["G"], m=c["M"], n=c["N"], k=c["K"]) for c in shapes_document()["cases"])


#: Tokens per expert a ``--rows-per-group`` run may ask for (M = rows x G stays allocatable).
MAX_ROWS_PER_GROUP = 1 << 16


#: Full-size MoE shapes take about half an hour on a CPU; by default a CPU run (bench, tune)
#: scales them down to a smoke run of a minute or two.
CPU_SCALE = 0.01


def default_scale(scale: float | None, cpu: bool) -> float:
    """``--scale`` as given, else 1 on a GPU and ``CPU_SCALE`` on the CPU."""
    if scale is not None:
        return scale
    return CPU_SCALE if cpu else 1.0


def select_cases(spec: str, scale: float = 1.0, rows_per_group: str | None = None) -> list[Case]:
    """Cases named by ``spec``: ``"all"`` or comma-separated names, scaled by ``scale``;
    with ``rows_per_group`` (comma-separated positive ints) each case once per token count
    instead of at its own M."""
    if not isinstance(scale, (int, float)) or not 0.0 < scale <= 1.0:
        raise InvalidArgumentError("scale", scale, "a number in (0, 1]: 1 is the real shapes, 0.01 a CPU smoke run")
    cases = all_cases()
    if spec.strip() == "all":
        chosen = list(cases)
    else:
        by_name = {c.name: c for c in cases}
        names = parse_list(spec, "cases", (*by_name, "all"))
        if "all" in names:
            raise InvalidArgumentError("cases", spec, "'all' alone or a list of case names, not both")
        chosen = [by_name[n] for n in names]
    scaled = [c.scaled(float(scale)) for c in chosen]
    if rows_per_group is None:
        return scaled
    counts = [v.strip() for v in rows_per_group.split(",") if v.strip()]
    if not counts or not all(v.isdigit() and 0 < int(v) <= MAX_ROWS_PER_GROUP for v in counts):
        raise InvalidArgumentError(
            "rows-per-group", rows_per_group, f"comma-separated integers from 1 to {MAX_ROWS_PER_GROUP}"
        )
    return [c.with_rows_per_group(int(v)) for c in scaled for v in dict.fromkeys(counts)]


def parse_list(value: str, argument: str, allowed: tuple[str, ...]) -> list[str]:
    """Comma-separated names, each checked against ``allowed``; order kept, repeats dropped."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        raise InvalidArgumentError(argument, value, f"a comma-separated list of {', '.join(allowed)}")
    for name in names:
        if name not in allowed:
            raise InvalidArgumentError(argument, name, f"one of {', '.join(allowed)}")
    return list(dict.fromkeys(names))
