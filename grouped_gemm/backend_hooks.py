"""Calling a backend's hooks (``check``, ``priority``, ``prepare``) so that its mistakes stay
its own: an exception or a malformed answer becomes a ``plugin`` reason against that backend
alone (logged once with its traceback), never an error of the call."""

from __future__ import annotations

from typing import Any

from grouped_gemm.config import LOGGER
from grouped_gemm.contract import Reason
from grouped_gemm.eligibility import declared_reasons
from grouped_gemm.plugins import PLUGIN_ERRORS
from grouped_gemm.problem import Problem
from grouped_gemm.registry import Entry

#: (backend, what misbehaved, exception type or kind of malformed answer) already logged: a broken
#: plugin is logged once with its traceback, not on every decision.
_logged_plugin_bugs: set[tuple[str, str, str]] = set()


def _plugin_bug(name: str, what: str, detail: str, exc: BaseException | None = None, kind: str = "") -> Reason:
    """A misbehaving hook as a reason for that backend alone. Logged once per ``kind`` of
    mistake (else the exception's type), not per ``detail``: a malformed answer's repr may
    name the problem, and a key holding it would log (and keep) one more on every decision."""
    token = (name, what, type(exc).__name__ if exc is not None else kind)
    if token not in _logged_plugin_bugs:
        _logged_plugin_bugs.add(token)
        LOGGER.warning("grouped_gemm backend %s: %s %s", name, what, detail, exc_info=exc)
    return Reason("plugin", f"{what} {detail}")


def _checked_reasons(name: str, hook: str, answer: Any) -> list[Reason]:
    """A ``check()`` / ``prepare()`` answer as reasons: a list or tuple of ``Reason`` objects,
    else one reason saying what came back instead."""
    if not isinstance(answer, (list, tuple)):
        return [
            _plugin_bug(
                name,
                hook,
                f"returned {_short(answer)}, not a list of gg.Reason",
                kind=f"answer {type(answer).__name__}",
            )
        ]
    bad = [r for r in answer if not isinstance(r, Reason)]
    if bad:
        return [
            _plugin_bug(
                name,
                hook,
                f"returned {_short(bad[0])} among its reasons, not a gg.Reason",
                kind=f"item {type(bad[0]).__name__}",
            )
        ]
    return list(answer)


def evaluate(entry: Entry, problem: Problem) -> tuple[tuple[Reason, ...], int]:
    """Reasons and priority of one backend; a plugin bug becomes a reason, not a crash."""
    name = entry.spec.name
    reasons = declared_reasons(entry.spec, problem)
    try:
        reasons += _checked_reasons(name, "check()", entry.backend.check(problem))
    except PLUGIN_ERRORS as exc:  # a broken check() must not break dispatch
        reasons.append(_plugin_bug(name, "check()", f"raised {type(exc).__name__}: {exc}", exc))
    priority = entry.spec.priority
    priority_of = getattr(entry.backend, "priority", None)
    if callable(priority_of):
        try:
            answer = priority_of(problem)
        except PLUGIN_ERRORS as exc:  # nor a broken priority()
            reasons.append(_plugin_bug(name, "priority()", f"raised {type(exc).__name__}: {exc}", exc))
        else:
            if isinstance(answer, int) and not isinstance(answer, bool):
                priority = answer
            else:
                reasons.append(
                    _plugin_bug(
                        name,
                        "priority()",
                        f"returned {_short(answer)}, not an int",
                        kind=f"answer {type(answer).__name__}",
                    )
                )
    return tuple(reasons), priority


def prepared_reasons(entry: Entry, problem: Problem) -> list[Reason]:
    """The reasons of a backend's ``prepare`` (optional), a plugin bug among them."""
    prepare = getattr(entry.backend, "prepare", None)
    if not callable(prepare):
        return []
    name = entry.spec.name
    try:
        answer = prepare(problem)
    except PLUGIN_ERRORS as exc:  # a broken prepare() must not break dispatch
        return [_plugin_bug(name, "prepare()", f"raised {type(exc).__name__}: {exc}", exc)]
    return _checked_reasons(name, "prepare()", answer)


def _short(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"{text} ({type(value).__name__})"
