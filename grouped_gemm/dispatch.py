"""Dispatch: rank the backends for a problem, pick the first eligible one, cache it.

One bounded cache maps a call's key (``validation.CallKey``: its arguments' signature,
with M bucketed) plus the active scopes and the per-call ``backend=`` to the call's
Problem and route, so a repeated call costs one dict lookup. A miss builds the Problem
(``Call.problem``), ranks every backend (``decide``) and caches both. Configuration,
registry and emulated-device changes drop every cached route. Reasons are logged at DEBUG
whenever a decision is made; with fallback warnings on, a ``FallbackWarning`` is emitted
once per (signature, decision).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings
from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch

from grouped_gemm import autotune, config
from grouped_gemm.backend_hooks import evaluate, prepared_reasons
from grouped_gemm.contract import BackendLike, Reason
from grouped_gemm.decision import Candidate, Decision
from grouped_gemm.device import on_change as on_device_change
from grouped_gemm.errors import BackendRunError, BackendUnavailableError, UnknownBackendError
from grouped_gemm.plugins import PLUGIN_ERRORS
from grouped_gemm.problem import Problem
from grouped_gemm.registry import Entry, Registry, registry
from grouped_gemm.registry import on_change as on_registry_change
from grouped_gemm.results import check_unmodified, checked_result, input_versions
from grouped_gemm.torch_device import device_kind

if TYPE_CHECKING:
    from grouped_gemm.validation import Call

LOGGER = config.LOGGER
_STRIDED = torch.strided
#: Whether autocast is on for any device type in this thread: torch's C query, without
#: ``torch.is_autocast_enabled``'s per-device argument parsing (every call asks).
_any_autocast = torch._C._is_any_autocast_enabled


class FallbackWarning(UserWarning):
    """A preferred backend was skipped; the message says which, why, and what ran."""


@dataclasses.dataclass
class _Routed:
    """A cached call: its Problem (the latest M of its bucket), its decision, and what the
    hot path needs from it. ``by_m`` keeps the bucket's Problems per M: a decode or training
    loop comes back to the same few token counts, and building a Problem for another M
    (``dataclasses.replace``) costs ~7 us of host time on the dev CPU, on every call whose M
    differs from the call before (issue 14)."""

    problem: Problem
    decision: Decision
    backend: BackendLike | None
    fallback_pairs: tuple[tuple[str, str], ...]
    fallbacks: tuple[str, ...]
    debug: bool
    cached: bool = False
    calls: int = 0
    used: bool = False
    config: Any = None
    tune_pending: bool = False
    by_m: dict[int, Problem] = dataclasses.field(default_factory=dict)


#: Problems kept per route, one per M (a bucket spans M to 2M); the oldest go first.
MAX_PROBLEMS_PER_ROUTE = 64


def check_names(names: tuple[str, ...], reg: Registry, argument: str) -> None:
    """UnknownBackendError for the first name no backend is registered under."""
    known = reg.names()
    for name in names:
        if name not in known:
            raise UnknownBackendError(argument, name, f"registered backends are {', '.join(sorted(known))}")


#: Where each level's order was written, for the error naming a backend it no longer finds
#: (unregistered since): not ``backend=`` for a call that passed none.
_ORDER_ARGUMENT = {
    "call": "backend",
    "scope": "use_backends(order)",
    "configure": "configure(backends=)",
    "env": "GROUPED_GEMM_BACKENDS",
}


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
            check_names(names, reg, _ORDER_ARGUMENT[source])
            return source, names, strict, warn
    return ("autotune" if tune else "priority"), (), strict, warn


def decide(problem: Problem, call_order: config.Order | None = None) -> tuple[Decision, bool]:
    """Rank every registered backend for ``problem``; returns (decision, warn_fallback)."""
    reg = registry()
    source, names, strict, warn = _preference(problem, call_order, reg)
    evaluated: dict[str, tuple[Entry, tuple[Reason, ...], int]] = {}
    for entry in reg.entries():
        reasons, priority = evaluate(entry, problem)
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
    while True:  # the selected backend prepares; one that cannot gives way to the next
        decision = Decision(
            problem=problem,
            candidates=tuple(candidates),
            selected=next((c.name for c in candidates if c.eligible), None),
            order_source=source,
            order=tuple(names),
            strict=strict,
        )
        if source == "autotune":
            decision = autotune.TUNER.apply(decision)
        if decision.selected is None or not problem.device.detected:
            break  # a described device runs nothing here: there is nothing to prepare for
        reasons = prepared_reasons(evaluated[decision.selected][0], problem)
        if not reasons:
            break
        at = next(i for i, c in enumerate(candidates) if c.name == decision.selected)
        candidates[at] = dataclasses.replace(candidates[at], reasons=candidates[at].reasons + tuple(reasons))
    if LOGGER.isEnabledFor(10):
        LOGGER.debug("grouped_gemm decision:\n%s", decision.table())
    return decision, warn


def _debug_checks() -> bool:
    """``debug`` from the innermost scope that sets it, else the settings."""
    for scope in reversed(config.active_scopes()):
        if scope.debug is not None:
            return scope.debug
    return config.settings().debug


def call_order(backend: Any) -> config.Order | None:
    """A per-call ``backend=`` (a name, an order string, a list of names or a recipe ->
    names mapping) as an order."""
    return None if backend is None else config.parse_order(backend, "backend")


#: Marks a ``backend=`` mapping's parsed order in a cache key: no value a caller passes is it.
_MAPPING = object()


def _order_key(backend: Any) -> Any:
    """``backend=`` as part of the cache key: a list as a tuple, a mapping (unhashable) by
    its parsed order."""
    if isinstance(backend, list):
        return tuple(backend)
    if isinstance(backend, Mapping):
        return (_MAPPING, call_order(backend))
    return backend


#: Calls kept per process (a run of distinct shapes or failing ``backend=`` values must not
#: grow memory without bound). Eviction is CLOCK, the second-chance approximation of LRU:
#: a hit only sets a flag (no reordering, so no second hash of the key on the hot path);
#: the oldest entry not used since it was last passed over is dropped.
ROUTE_CACHE_SIZE = 1024


class Dispatcher:
    """The call cache, fallback warnings and statistics of one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, _Routed] = OrderedDict()
        self._generation = 0
        self._warned: set[tuple] = set()
        self._live: list[_Routed] = []
        self._retired: Counter[tuple[str, str]] = Counter()

    def run(self, call: Call, backend: Any) -> Any:
        """Route the call (its cached route, or decide one), run it, and check what the
        backend returned against the problem.

        A backend's exception, a result of the wrong type, layout, shape, dtype or device,
        and (in debug mode) an input it modified in place all come back as BackendRunError.
        Backends run with the caller's ``torch.autocast`` off: the recipe decides the
        formats (docs/module.md), and a backend computing with torch ops would otherwise
        run them in the region's bf16 / fp16 and return, say, fp32 with bf16 rounding.
        """
        if _any_autocast():  # one C call on every call; the region's work only inside one
            with torch.autocast(device_kind(call.key.device), enabled=False):
                return self._run(call, backend)
        return self._run(call, backend)

    def _run(self, call: Call, backend: Any) -> Any:
        """``run`` outside any autocast region."""
        order_key = backend if backend is None or type(backend) is str else _order_key(backend)
        key = (call.key, config.active_scopes(), order_key)
        try:
            routed = self._cache.get(key)
        except TypeError:  # an unhashable recipe= or out_dtype= (the Problem will say why)
            routed = key = None
        if routed is None or (routed.tune_pending and autotune.can_measure(routed.problem)):
            routed = self._route(key, call, backend)
        else:
            routed.used = True
        problem = routed.problem
        if problem.m != call.m:  # another M of the same bucket: same route, its own Problem
            problem = routed.by_m.get(call.m)
            if problem is None:
                problem = dataclasses.replace(routed.problem, m=call.m)
                with self._lock:  # threads adding M at once must not evict the same oldest one
                    routed.by_m[call.m] = problem
                    while len(routed.by_m) > MAX_PROBLEMS_PER_ROUTE:
                        del routed.by_m[next(iter(routed.by_m))]
            routed.problem = problem
        chosen = routed.backend
        if chosen is None:
            raise BackendUnavailableError(f"no backend can run {problem}:\n{routed.decision.table()}", routed.decision)
        # acquire / release, not ``with``: the context-manager protocol (two special-method
        # lookups, a three-argument __exit__) cost ~0.17 us more a call on the dev CPU.
        lock = self._lock
        lock.acquire()
        try:
            if routed.cached:
                routed.calls += 1
            else:
                self._retired.update(_counts(routed))
        finally:
            lock.release()
        inputs = call.inputs
        name = routed.decision.selected  # as registered (the backend may have replaced its spec)
        versions = input_versions(inputs) if routed.debug else None
        try:
            if routed.config is None:
                result = chosen.run(problem, inputs)
            else:
                result = chosen.run_config(problem, inputs, routed.config)
        except PLUGIN_ERRORS as exc:  # SystemExit too: a backend's sys.exit must not end the caller
            raise BackendRunError(name, problem, exc) from exc
        if versions is not None:
            check_unmodified(name, problem, inputs, versions)
        # The common case in few attribute reads (the operands' device as validation read
        # it); checked_result says what is wrong.
        try:
            if (
                inputs.out is None
                and type(result) is torch.Tensor
                and result.layout is _STRIDED  # sparse, mkldnn, jagged: checked_result names them
                and result.dtype is problem.out_torch_dtype
                and result.shape == problem.out_shape
                and result.device == call.key.device
                and not result.requires_grad
            ):
                return result
        except RuntimeError:  # a (strided) nested tensor's shape raises: checked_result names it
            pass
        return checked_result(name, problem, inputs, result)

    def _route(self, key: tuple | None, call: Call, backend: Any) -> _Routed:
        """The slow path: build the call's Problem, decide (measuring first when autotune
        waits for this call), and cache both under ``key`` (None: not cacheable)."""
        generation = self._generation  # a change from here on (configure, ...) leaves it uncached
        problem = call.problem()
        order = call_order(backend)
        while True:
            decision, warn = decide(problem, order)
            if decision.tune_pending and autotune.can_measure(problem):
                autotune.TUNER.measure(problem, call.inputs, decision)
                self.clear()  # routes decided before (under capture, say) may use the measurement now
                generation = self._generation
                decision, warn = decide(problem, order)
            selected = _registered(decision.selected)
            # False: the winner was unregistered (another thread) after decide() ranked it;
            # decide again among the backends there are, rather than fail a call that named none.
            if selected is not False:
                break
        chosen = decision.selected or "none"
        routed = _Routed(
            problem,
            decision,
            selected,
            tuple((c.name, r.code) for c in decision.skipped for r in c.reasons),
            tuple(f"{c.name} -> {chosen}" for c in decision.skipped if c.preferred),
            _debug_checks(),
            config=decision.config,
            tune_pending=decision.tune_pending,
            by_m={problem.m: problem},
        )
        with self._lock:
            if key is not None and generation == self._generation:
                routed.cached = True
                replaced = self._cache.pop(key, None)  # another thread's, or one waiting to be tuned
                if replaced is not None:
                    self._retire([replaced])
                self._cache[key] = routed
                self._live.append(routed)
                while len(self._cache) > ROUTE_CACHE_SIZE:
                    old_key, old = self._cache.popitem(last=False)
                    if old.used:  # a second chance: back to the end, flag cleared
                        old.used = False
                        self._cache[old_key] = old
                    else:
                        self._retire([old])
        if decision.fallback:
            LOGGER.info("grouped_gemm fallback: %s", decision.summary())
            if warn:
                self._warn_once(decision)
        return routed

    def _retire(self, routes: list[_Routed]) -> None:
        """Fold dropped routes' counts into the totals (holding the lock)."""
        gone = {id(r) for r in routes}
        for routed in routes:
            routed.cached = False
            for item in _counts(routed):
                self._retired[item] += routed.calls
            routed.calls = 0
        self._live = [r for r in self._live if id(r) not in gone]

    def clear(self) -> None:
        """Drop every cached route (their counts stay in the statistics)."""
        with self._lock:
            self._retire(list(self._cache.values()))
            self._cache.clear()
            self._generation += 1

    def _warn_once(self, decision: Decision) -> None:
        token = (decision.problem.signature, decision.selected, tuple(c.name for c in decision.skipped))
        with self._lock:
            if token in self._warned:
                return
            if len(self._warned) >= ROUTE_CACHE_SIZE:
                self._warned.clear()
            self._warned.add(token)
        # _warn_once, _route, Dispatcher._run, Dispatcher.run, the public function: its caller.
        warnings.warn(f"grouped_gemm fallback: {decision.summary()}", FallbackWarning, stacklevel=6)

    def stats(self) -> dict[str, Any]:
        """Calls per selected backend; fallbacks as ``"skipped -> selected"`` for named
        backends that were skipped; skips per ``"backend:reason code"``."""
        with self._lock:
            totals = Counter(self._retired)
            for routed in self._live:
                for item in _counts(routed):
                    totals[item] += routed.calls
        by_kind: dict[str, dict[str, int]] = {"selected": {}, "fallbacks": {}, "skipped": {}}
        for (kind, label), count in sorted(totals.items()):
            if count:
                by_kind[kind][label] = count
        return {"calls": sum(by_kind["selected"].values()), **by_kind, "autotune": autotune.TUNER.counters()}

    def reset_stats(self) -> None:
        """Forget counts and warned decisions (the cache stays)."""
        autotune.TUNER.reset_counters()
        with self._lock:
            for routed in self._cache.values():
                routed.calls = 0
            self._live = list(self._cache.values())
            self._retired.clear()
            self._warned.clear()


def _registered(name: str | None) -> BackendLike | Literal[False] | None:
    """The backend registered as ``name`` (None for no name), False if there is none now."""
    if name is None:
        return None
    try:
        return registry().get(name).backend
    except UnknownBackendError:
        return False


def _counts(routed: _Routed) -> list[tuple[str, str]]:
    """The statistics keys one call of a route adds to."""
    items = [("selected", routed.decision.selected or "none")]
    items += [("fallbacks", pair) for pair in routed.fallbacks]
    items += [("skipped", f"{n}:{code}") for n, code in routed.fallback_pairs]
    return items


DISPATCHER = Dispatcher()
config.on_change(DISPATCHER.clear)
on_registry_change(DISPATCHER.clear)
on_device_change(DISPATCHER.clear)


def _after_fork() -> None:
    # A thread of the parent may have held the lock at fork; the child has no such thread.
    DISPATCHER._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
