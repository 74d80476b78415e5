"""Dispatch: rank the backends for a problem, pick the first eligible one, cache it.

A cached call costs one dict lookup keyed by (problem signature, settings version,
active scopes, per-call order, registry epoch). Reasons are logged at DEBUG whenever a
decision is made; with fallback warnings on, a ``FallbackWarning`` is emitted once per
(signature, decision).
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections import Counter
from typing import Any

from grouped_gemm import autotune, config
from grouped_gemm.contract import BackendLike, Reason
from grouped_gemm.decision import Candidate, Decision
from grouped_gemm.eligibility import declared_reasons
from grouped_gemm.errors import BackendRunError, BackendUnavailableError, UnknownBackendError
from grouped_gemm.inputs import GroupedInputs
from grouped_gemm.problem import Problem
from grouped_gemm.registry import Entry, Registry, _registry, registry

LOGGER = config.LOGGER


class FallbackWarning(UserWarning):
    """A preferred backend was skipped; the message says which, why, and what ran."""


@dataclasses.dataclass
class _Routed:
    """A cached decision plus what the hot path needs from it."""

    decision: Decision
    backend: BackendLike | None
    fallback_pairs: tuple[tuple[str, str], ...]
    calls: int = 0
    config: Any = None
    tune_pending: bool = False


def _evaluate(entry: Entry, problem: Problem) -> tuple[tuple[Reason, ...], int]:
    """Reasons and priority of one backend; a plugin bug becomes a reason, not a crash."""
    reasons = declared_reasons(entry.spec, problem)
    try:
        reasons += list(entry.backend.check(problem))
    except Exception as exc:  # noqa: BLE001 - a broken check() must not break dispatch
        reasons.append(Reason("missing", f"check() raised {type(exc).__name__}: {exc}"))
    priority_of = getattr(entry.backend, "priority", None)
    try:
        priority = int(priority_of(problem)) if callable(priority_of) else entry.spec.priority
    except Exception as exc:  # noqa: BLE001 - nor a broken priority()
        priority = entry.spec.priority
        reasons.append(Reason("missing", f"priority() raised {type(exc).__name__}: {exc}"))
    return tuple(reasons), priority


def check_names(names: tuple[str, ...], reg: Registry, argument: str) -> None:
    """UnknownBackendError for the first name no backend is registered under."""
    known = reg.names()
    for name in names:
        if name not in known:
            raise UnknownBackendError(argument, name, f"registered backends are {', '.join(sorted(known))}")


def _preference(
    problem: Problem, call_order: config.Order | None, reg: Registry
) -> tuple[str, tuple[str, ...], bool, bool]:
    """(source, names, strict, warn) for a problem from every configuration level."""
    current = config.settings()
    strict, warn, tune = current.strict, current.warn_fallback, current.autotune
    scopes = config.active_scopes()
    for scope in scopes:
        strict = scope.strict if scope.strict is not None else strict
        warn = scope.warn_fallback if scope.warn_fallback is not None else warn
        tune = scope.autotune if scope.autotune is not None else tune
    levels: list[tuple[str, config.Order | None]] = [("call", call_order)]
    levels += [("scope", s.order) for s in reversed(scopes)]
    levels.append(("configure" if config.set_in_code("backends") else "env", current.backends))
    for source, order in levels:
        names = config.order_for(order, problem.recipe)
        if names:
            check_names(names, reg, "GROUPED_GEMM_BACKENDS" if source == "env" else "backend")
            return source, names, strict, warn
    return ("autotune" if tune else "priority"), (), strict, warn


def decide(problem: Problem, call_order: config.Order | None = None) -> tuple[Decision, bool]:
    """Rank every registered backend for ``problem``; returns (decision, warn_fallback)."""
    reg = registry()
    source, names, strict, warn = _preference(problem, call_order, reg)
    evaluated: dict[str, tuple[Entry, tuple[Reason, ...], int]] = {}
    for entry in reg.entries():
        reasons, priority = _evaluate(entry, problem)
        evaluated[entry.spec.name] = (entry, reasons, priority)
    preferred = [n for n in names if n in evaluated]
    rest = sorted((n for n in evaluated if n not in names), key=lambda n: (-evaluated[n][2], n))
    candidates = []
    for name in preferred + rest:
        entry, reasons, priority = evaluated[name]
        if strict and names and name not in names:
            reasons = reasons + (Reason("config", "strict mode: not among the named backends"),)
        candidates.append(
            Candidate(
                name=name,
                plugin=entry.plugin,
                version=entry.spec.version,
                priority=priority,
                preferred=name in names,
                reasons=reasons,
            )
        )
    selected = next((c.name for c in candidates if c.eligible), None)
    decision = Decision(
        problem=problem,
        candidates=tuple(candidates),
        selected=selected,
        order_source=source,
        order=tuple(names),
        strict=strict,
    )
    if source == "autotune":
        decision = autotune.TUNER.apply(decision)
    if LOGGER.isEnabledFor(10):
        LOGGER.debug("grouped_gemm decision:\n%s", decision.table())
    return decision, warn


class Dispatcher:
    """The decision cache, fallback warnings and statistics of one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[tuple, _Routed] = {}
        self._stamp: tuple[int, int] = (-1, -1)
        self._warned: set[tuple] = set()
        self._all: list[_Routed] = []

    def route(self, problem: Problem, call_order: config.Order | None, inputs: GroupedInputs | None = None) -> _Routed:
        """The cached route for a problem, deciding (and warning) on a miss; with
        ``inputs``, an autotune decision still pending is measured on them first."""
        reg = _registry if _registry._loaded else registry()
        stamp = (config._state.version, reg.epoch)
        key = (problem.signature, config._scopes.get(), call_order)
        if stamp == self._stamp:
            routed = self._cache.get(key)
            if routed is not None and not (
                routed.tune_pending and inputs is not None and autotune.can_measure(problem)
            ):
                return routed
        decision, warn = decide(problem, call_order)
        if decision.tune_pending and inputs is not None and autotune.can_measure(problem):
            autotune.TUNER.measure(problem, inputs, decision)
            with self._lock:  # routes decided before (under capture, say) may use it now
                self._cache = {}
            decision, warn = decide(problem, call_order)
        backend = reg.get(decision.selected).backend if decision.selected else None
        pairs = tuple((c.name, r.code) for c in decision.skipped for r in c.reasons)
        routed = _Routed(
            decision=decision,
            backend=backend,
            fallback_pairs=pairs,
            config=decision.config,
            tune_pending=decision.tune_pending,
        )
        with self._lock:
            if stamp != self._stamp:
                self._cache = {}
                self._stamp = stamp
            self._cache[key] = routed
            self._all.append(routed)
        if decision.fallback:
            LOGGER.info("grouped_gemm fallback: %s", decision.summary())
            if warn:
                self._warn_once(decision)
        return routed

    def _warn_once(self, decision: Decision) -> None:
        token = (decision.problem.signature, decision.selected, tuple(c.name for c in decision.skipped))
        with self._lock:
            if token in self._warned:
                return
            self._warned.add(token)
        warnings.warn(f"grouped_gemm fallback: {decision.summary()}", FallbackWarning, stacklevel=5)

    def run(self, problem: Problem, inputs: GroupedInputs, call_order: config.Order | None) -> Any:
        """Route and run; a backend's exception comes back as BackendRunError."""
        routed = self.route(problem, call_order, inputs)
        backend = routed.backend
        if backend is None:
            raise BackendUnavailableError(f"no backend can run {problem}:\n{routed.decision.table()}", routed.decision)
        with self._lock:
            routed.calls += 1
        try:
            if routed.config is None:
                result = backend.run(problem, inputs)
            else:
                result = backend.run_config(problem, inputs, routed.config)
        except Exception as exc:
            raise BackendRunError(backend.spec.name, problem, exc) from exc
        out = inputs.out
        if out is not None and result is not out and not isinstance(out, list):
            out.copy_(result)
            return out
        return result

    def stats(self) -> dict[str, Any]:
        """Selections and fallbacks per backend, skips per (backend, reason code)."""
        selected: Counter[str] = Counter()
        fallbacks: Counter[str] = Counter()
        skipped: Counter[tuple[str, str]] = Counter()
        with self._lock:
            routes = list(self._all)
        for routed in routes:
            if not routed.calls:
                continue
            name = routed.decision.selected or "none"
            selected[name] += routed.calls
            if routed.fallback_pairs:
                fallbacks[name] += routed.calls
            for pair in routed.fallback_pairs:
                skipped[pair] += routed.calls
        return {
            "calls": sum(selected.values()),
            "selected": dict(selected),
            "fallbacks": dict(fallbacks),
            "skipped": {f"{n}:{code}": v for (n, code), v in sorted(skipped.items())},
            "autotune": autotune.TUNER.counters(),
        }

    def reset_stats(self) -> None:
        """Forget counts and warned decisions (the cache stays)."""
        autotune.TUNER.reset_counters()
        with self._lock:
            for routed in self._all:
                routed.calls = 0
            self._all = list(self._cache.values())
            self._warned.clear()


DISPATCHER = Dispatcher()
