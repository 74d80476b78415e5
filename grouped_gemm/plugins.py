"""Plugins: pluggy hook specs, built-in plugin names, entry-point discovery.

Built-in backends are plugins like any other, listed by module name in
``DEFAULT_PLUGINS`` (pytest's pattern), so they register without installed entry-point
metadata and the core never imports a backend by name. Third-party plugins come from
the entry-point group ``grouped_gemm``. Each plugin is imported and called on its own:
one that fails is recorded with its error and the rest keep working.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import pluggy

from grouped_gemm.config import LOGGER, plugin_autoload_disabled

PROJECT = "grouped_gemm"
ENTRY_POINT_GROUP = "grouped_gemm"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

DEFAULT_PLUGINS = (
    "grouped_gemm.backends.reference",
    "grouped_gemm.backends.torch_grouped_mm",
    "grouped_gemm.backends.torch_scaled_grouped_mm",
    "grouped_gemm.backends.multistream",
    "grouped_gemm.backends.triton_mx",
    "grouped_gemm.backends.hip_mxfp8",
)


class HookSpecs:
    """The hooks a grouped_gemm plugin may implement."""

    @hookspec
    def grouped_gemm_backends(self, register: Callable[[Any], None]) -> Iterable[Any] | None:
        """Provide backends: return an iterable of them, or call ``register(backend)``."""


@dataclasses.dataclass(frozen=True)
class PluginFailure:
    """A plugin that could not be loaded or whose backends were rejected."""

    plugin: str
    stage: str
    error: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.plugin} ({self.stage}): {self.error}"


#: What a plugin's import, hook or backend's ``check`` / ``priority`` / ``prepare`` may raise
#: without ending the process: any Exception, and SystemExit (a module that parses the command
#: line at import, a stray ``sys.exit``), which would otherwise exit the application from
#: inside a grouped_gemm call.
PLUGIN_ERRORS = (Exception, SystemExit)


def _failure(plugin: str, stage: str, exc: BaseException) -> PluginFailure:
    LOGGER.warning("grouped_gemm plugin %s failed at %s: %s", plugin, stage, exc, exc_info=exc)
    return PluginFailure(
        plugin=plugin,
        stage=stage,
        error=f"{type(exc).__name__}: {exc}",
        detail="".join(traceback.format_exception(exc)),
    )


def _available_plugins() -> tuple[list[tuple[str, Any]], list[PluginFailure]]:
    """(name, module) of every plugin that imports, and the failures of the others."""
    loaded: list[tuple[str, Any]] = []
    failures: list[PluginFailure] = []
    for name in DEFAULT_PLUGINS:
        try:
            loaded.append((name, importlib.import_module(name)))
        except PLUGIN_ERRORS as exc:  # any import error is reported, not raised
            failures.append(_failure(name, "import", exc))
    if plugin_autoload_disabled():
        return loaded, failures
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        label = f"{ep.name} ({ep.value})"
        try:
            loaded.append((label, ep.load()))
        except PLUGIN_ERRORS as exc:  # likewise for third-party plugins
            failures.append(_failure(label, "import", exc))
    return loaded, failures


def collect(register: Callable[[Any, str], None]) -> list[PluginFailure]:
    """Load every plugin and hand each backend it provides to ``register(backend, plugin)``.

    Returns the failures; a failing plugin never stops the others.
    """
    manager = pluggy.PluginManager(PROJECT)
    manager.add_hookspecs(HookSpecs)
    plugins, failures = _available_plugins()
    registered: list[tuple[str, Any]] = []
    for name, module in plugins:
        if manager.is_registered(module):
            continue
        try:
            manager.register(module, name=name)
        except Exception as exc:  # noqa: BLE001 - e.g. a hookimpl with a wrong signature
            failures.append(_failure(name, "register", exc))
        else:
            registered.append((name, module))
    impls = manager.hook.grouped_gemm_backends.get_hookimpls()
    providing = {impl.plugin_name for impl in impls}
    for name, module in registered:
        ignored = _ignored_hooks(name, module, name in providing)
        failures += [ignored] if ignored else []
    for impl in _builtins_first(impls):
        name = impl.plugin_name

        def add(backend: Any, _plugin: str = name) -> None:
            try:
                register(backend, _plugin)
            except Exception as exc:  # noqa: BLE001 - a rejected backend spares the rest
                failures.append(_failure(_plugin, "register backend", exc))

        try:
            kwargs = {"register": add} if "register" in impl.argnames else {}
            returned = impl.function(**kwargs)
            if isinstance(returned, (str, bytes)) or (returned is not None and not hasattr(returned, "__iter__")):
                raise TypeError(f"the hook returned {type(returned).__name__}; expected an iterable of backends")
            for backend in returned or ():
                add(backend)
        except PLUGIN_ERRORS as exc:  # a failing hook spares the other plugins
            failures.append(_failure(name, "backends", exc))
    return failures


def _ignored_hooks(plugin: str, module: Any, provides: bool) -> PluginFailure | None:
    """What pluggy ignores without a word: a ``@hookimpl`` function of no grouped_gemm hook
    (a misspelling) and, in a plugin without the hook, an undecorated ``grouped_gemm_backends``.
    The backends meant would be missing with no failure to say why. (No hook alone is no
    mistake: a plugin may register its backends when imported.)"""
    namespace = getattr(module, "__dict__", {})
    unknown = sorted(
        attr
        for attr, value in namespace.items()
        if inspect.isfunction(value)
        and isinstance(opts := getattr(value, f"{PROJECT}_impl", None), dict)
        and (opts.get("specname") or attr) != "grouped_gemm_backends"
    )
    if unknown:
        error = f"@grouped_gemm.hookimpl on {', '.join(unknown)}, which is no grouped_gemm hook (grouped_gemm_backends)"
    elif not provides and inspect.isfunction(namespace.get("grouped_gemm_backends")):
        error = "its grouped_gemm_backends is not decorated with @grouped_gemm.hookimpl"
    else:
        return None
    LOGGER.warning("grouped_gemm plugin %s: %s", plugin, error)
    return PluginFailure(plugin=plugin, stage="hooks", error=error)


def _builtins_first(impls: list[Any]) -> list[Any]:
    """Hook implementations with the built-ins first, in ``DEFAULT_PLUGINS`` order.

    pluggy orders hooks by ``tryfirst`` / ``trylast`` and registration; a third-party
    plugin could use that to register a backend under a built-in's name before the
    built-in and replace it. Registered first, the built-in keeps its name and the later
    duplicate is the one rejected and reported in ``plugin_failures()``.
    """
    rank = {name: i for i, name in enumerate(DEFAULT_PLUGINS)}
    return sorted(impls, key=lambda impl: rank.get(impl.plugin_name, len(rank)))
