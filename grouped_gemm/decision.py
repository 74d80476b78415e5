"""Decision: which backend a problem goes to, every other backend and why it was not it."""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from grouped_gemm.contract import Reason
from grouped_gemm.problem import Problem

if TYPE_CHECKING:
    from grouped_gemm.tuning_store import Tuning

#: Reason codes that mean "this backend was never meant for this kind of call" (a GPU
#: backend on CPU tensors, a bf16-only backend for an MX recipe). Skipping such a
#: backend is not a fallback unless the user named it.
NOT_IN_THE_RUNNING = frozenset({"vendor", "placement", "op", "recipe"})


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One backend as dispatch saw it for one problem."""

    name: str
    plugin: str
    version: str
    priority: int
    preferred: bool
    reasons: tuple[Reason, ...]

    @property
    def eligible(self) -> bool:
        return not self.reasons

    @property
    def relevant(self) -> bool:
        """Whether skipping it counts as a fallback: it was named, or nothing says it was
        never meant for this kind of call."""
        return self.preferred or not any(r.code in NOT_IN_THE_RUNNING for r in self.reasons)


@dataclasses.dataclass(frozen=True)
class Decision:
    """The full routing decision for one problem signature.

    ``candidates`` are in rank order; ``order_source`` says which level set the
    preference (``call``, ``scope``, ``configure``, ``env``, ``autotune`` or
    ``priority``). With ``autotune``: ``tuning`` holds the measured times (None until
    the first call measures, ``tune_pending``), ``config`` the chosen kernel config.
    """

    problem: Problem
    candidates: tuple[Candidate, ...]
    selected: str | None
    order_source: str
    order: tuple[str, ...]
    strict: bool
    config: Mapping[str, Any] | None = None
    tuning: Tuning | None = None
    tune_pending: bool = False

    @property
    def skipped(self) -> tuple[Candidate, ...]:
        """Relevant candidates ranked above the selected one (all of them if none ran)."""
        out = []
        for c in self.candidates:
            if c.name == self.selected:
                break
            if c.relevant:
                out.append(c)
        return tuple(out)

    @property
    def fallback(self) -> bool:
        """True when a higher-ranked relevant backend was skipped."""
        return bool(self.skipped)

    def candidate(self, name: str) -> Candidate:
        for c in self.candidates:
            if c.name == name:
                return c
        raise KeyError(name)

    def summary(self) -> str:
        """One line per skipped backend and the chosen one (warnings, errors)."""
        lines = [f"{c.name}: " + "; ".join(str(r) for r in c.reasons) for c in self.skipped]
        chosen = self.selected or "none"
        return f"{self.problem}: selected {chosen}" + ("; skipped " + " | ".join(lines) if lines else "")

    def table(self, width: int = 100) -> str:
        """The decision as a table, every backend with its reasons wrapped to ``width`` columns."""
        if self.order:
            order = f"{', '.join(self.order)} (set by {self.order_source}){' strict' if self.strict else ''}"
        elif self.order_source == "autotune":
            order = "autotune (no order set; measured times rank the eligible backends, below)"
        else:
            order = "none set (per call, scope, configure or GROUPED_GEMM_BACKENDS), so priority decides"
        head = [
            f"problem: {self.problem}",
            f"device:  {self.problem.device}",
            f"order:   {order}",
        ]
        rows = [("rank", "backend", "prio", "eligible", "plugin")]
        rows += [
            (
                f"{rank}{'*' if c.name == self.selected else ''}",
                c.name,
                str(c.priority),
                "yes" if c.eligible else "no",
                c.plugin,
            )
            for rank, c in enumerate(self.candidates, 1)
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        body = []
        for i, row in enumerate(rows):
            body.append("  ".join(cell.ljust(w) for cell, w in zip(row, [*widths, 0], strict=True)).rstrip())
            if i:
                reasons = "; ".join(str(r) for r in self.candidates[i - 1].reasons)
                indent = {"initial_indent": "      ", "subsequent_indent": "        "}
                # Paths and names stay whole: a reader copies them.
                body += textwrap.wrap(reasons, width, break_long_words=False, break_on_hyphens=False, **indent)
        legend = (
            "* = selected; prio = the backend's priority for this problem (used when no order names it, "
            "higher first); eligible = no reason against it (reasons are indented below the backend)"
        )
        selected = f"selected: {self.selected or 'none (no eligible backend)'}"
        if self.config is not None:
            selected += " [" + ",".join(f"{k}={v}" for k, v in self.config.items()) + "]"
        tail = [selected, *textwrap.wrap(legend, width)]
        return "\n".join(head + body + tail) + self._tuning_table()

    def _tuning_table(self) -> str:
        """Measured times per contender, for ``order: autotune``."""
        if self.order_source != "autotune":
            return ""
        t = self.tuning
        if t is None:
            state = "pending: measured on the first call" if self.tune_pending else "nothing measured"
            return f"\nautotune: {state}; declared priority until then"
        lines = [
            f"\nautotune: {t.origin} {t.measured_at} at M={t.m}, cost {t.cost_ms:.1f} ms; "
            f"declared priority would pick {t.priority_choice or 'none'}"
        ]
        width = max(len(x.label) for x in t.timings)
        for x in t.timings:
            ms = f"{x.ms:10.4f} ms" if x.ms is not None else " " * 13
            chosen = "*" if x.backend == self.selected and x.config == self.config else " "
            lines.append(f"  {chosen} {x.label.ljust(width)}  {ms}  {x.calls:4d} calls  {x.note}".rstrip())
        if t.close_call is not None:
            lines.append(f"  {t.close_call.describe()}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()
