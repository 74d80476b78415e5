"""The backend registry: every backend by name, which plugin gave it, what failed.

Loaded lazily on first use. Every change bumps ``epoch`` (autotuning records name it)
and calls the ``on_change`` callbacks: the dispatcher drops its cached routes, so
registering a backend invalidates cached decisions.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable

from pydantic import ValidationError

from grouped_gemm.contract import BackendLike, BackendSpec
from grouped_gemm.errors import DuplicateBackendError, InvalidArgumentError, InvalidTypeError, UnknownBackendError
from grouped_gemm.plugins import PluginFailure, collect

#: The methods dispatch calls on a backend (``priority`` and ``prepare`` are optional): one
#: that is not callable (``priority = 50`` meant as the rank) would be skipped or fail later.
_HOOKS = ("check", "run", "priority", "prepare")


@dataclasses.dataclass(frozen=True)
class Entry:
    """A registered backend, the plugin that registered it, and its spec as registered:
    the registry keys it by that spec's name, so a ``spec`` the backend assigns itself
    later (another name, say) cannot make it unreachable under the name routing found."""

    backend: BackendLike
    plugin: str
    spec: BackendSpec


class Registry:
    """Name -> backend, with the plugin failures seen while loading."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._entries: dict[str, Entry] = {}
        self.failures: list[PluginFailure] = []
        self.epoch = 0
        self.max_m_multiple = 1
        self._loaded = False
        self._loading = False
        self._listeners: list[Callable[[], None]] = []

    def ensure_loaded(self) -> Registry:
        """Load built-in and entry-point plugins once.

        A plugin that uses the registry while it is imported (``gg.register_backend`` at
        module level) re-enters here on the loading thread: it gets the registry as loaded
        so far, not a second load that would register every plugin again.
        """
        if not self._loaded:
            with self._lock:
                if not self._loaded and not self._loading:
                    self._loading = True
                    try:
                        self.failures.extend(collect(self.register))
                        self._loaded = True
                    finally:
                        self._loading = False
        return self

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` after every registration and removal (without loading plugins)."""
        self._listeners.append(callback)

    def register(self, backend: object, plugin: str = "code") -> None:
        """Add a backend; its name must be new."""
        if isinstance(backend, type):  # the class has spec, check and run too; its methods are unbound
            raise InvalidTypeError(
                "backend", backend, f"an instance of the backend class: {backend.__name__}(), not the class"
            )
        spec = getattr(backend, "spec", None)
        if not isinstance(spec, BackendSpec) or not isinstance(backend, BackendLike):
            raise InvalidTypeError(
                "backend",
                backend,
                "an object with a BackendSpec `spec` and `check(problem)` / `run(problem, inputs)` methods",
            )
        for hook in _HOOKS:
            method = getattr(backend, hook, None)
            if method is not None and not callable(method):
                raise InvalidTypeError(f"backend.{hook}", method, f"a method {hook}(problem, ...) of the backend")
        spec = _validated(spec)
        with self._lock:
            existing = self._entries.get(spec.name)
            if existing is not None:
                raise DuplicateBackendError(
                    f"backend name {spec.name!r} from plugin {plugin!r} is already registered "
                    f"by plugin {existing.plugin!r}; backend names must be unique"
                )
            self._entries = {**self._entries, spec.name: Entry(backend, plugin, spec)}
            self._changed()
        self._notify()

    def unregister(self, name: str) -> BackendLike:
        """Remove a backend by name and return it."""
        with self._lock:
            entry = self.get(name)
            self._entries = {k: v for k, v in self._entries.items() if k != name}
            self._changed()
        self._notify()
        return entry.backend

    def _changed(self) -> None:
        self.epoch += 1
        self.max_m_multiple = max((e.spec.m_multiple for e in self._entries.values()), default=1)

    def _notify(self) -> None:
        for callback in self._listeners:
            callback()

    def get(self, name: str) -> Entry:
        """The entry for ``name``, or UnknownBackendError listing the known names."""
        entry = self._entries.get(name) if isinstance(name, str) else None
        if entry is None:
            raise UnknownBackendError("backend", name, f"registered backends are {', '.join(sorted(self._entries))}")
        return entry

    def entries(self) -> list[Entry]:
        """All entries, sorted by name (never by load order)."""
        return [self._entries[n] for n in sorted(self._entries)]

    def names(self) -> frozenset[str]:
        return frozenset(self._entries)


def _validated(spec: BackendSpec) -> BackendSpec:
    """``spec`` validated again: ``model_copy(update=...)`` (a built-in's spec adapted, say)
    skips validation, and an unchecked ``n_multiple=0`` would fail every decision, for every
    backend, while ``recipes="bf16"`` would be read as a set of letters."""
    try:
        return type(spec).model_validate(dict(spec))
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"])
        raise InvalidArgumentError(
            f"backend.spec.{field}", error.get("input"), f"{error['msg']} (backend {spec.name!r})"
        ) from None


_registry = Registry()


def registry() -> Registry:
    """The process-wide registry, loaded on first use (then returned without
    ``ensure_loaded``'s frame: every call asks)."""
    return _registry if _registry._loaded else _registry.ensure_loaded()


def on_change(callback: Callable[[], None]) -> None:
    """Call ``callback`` after every change of the process-wide registry (loading it
    included); subscribing does not load it."""
    _registry.on_change(callback)


def _after_fork() -> None:
    _registry._lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
