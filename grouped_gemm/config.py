"""Configuration: environment (read once) < ``configure`` in code < ``use_backends`` scopes.

Backend order precedence, highest first: the per-call ``backend=`` argument, the
innermost ``use_backends`` scope with an entry for the recipe, ``configure(backends=)``,
``GROUPED_GEMM_BACKENDS``, then each backend's declared priority. An order is a
preference: backends it names come first, the rest follow by priority, unless
``strict`` is on, in which case only the named ones may run. With ``autotune`` on
(``configure``, ``GROUPED_GEMM_AUTOTUNE``, or a scope's ``autotune=``), measured times
replace the declared priority; an order the user set still wins.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from grouped_gemm.errors import ConfigError
from grouped_gemm.recipes import RECIPES
from grouped_gemm.scope_stack import pushed

LOGGER = logging.getLogger("grouped_gemm")

#: An order as users write it: "a,b", "mxfp4:a,b;bf16:c", ["a", "b"] or {"mxfp4": [...]}.
OrderLike = str | Sequence[str] | Mapping[str, str | Sequence[str]]
#: An order as stored: sorted ((recipe or "*", (names...)), ...) pairs, hashable.
Order = tuple[tuple[str, tuple[str, ...]], ...]


class Settings(BaseModel):
    """The configurable values; ``None`` for ``backends`` means "no preference".

    Strict validation: a flag set in code must be a real ``bool`` (``strict="no"`` would
    otherwise be a truthy string doing the opposite of what was asked). Environment
    variables are strings and are parsed by ``_env_bool`` first.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    backends: Order | None = None
    warn_fallback: bool = False
    strict: bool = False
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] | None = None
    check_device_splits: bool = False
    debug: bool = False
    autotune: bool = False


@dataclasses.dataclass(frozen=True)
class Scope:
    """One ``use_backends`` frame; None fields inherit from outer levels."""

    order: Order | None
    strict: bool | None
    warn_fallback: bool | None
    debug: bool | None = None
    autotune: bool | None = None


def parse_order(value: OrderLike, argument: str = "backends") -> Order:
    """Normalize an order to sorted ``(recipe or "*", names)`` pairs, checking syntax
    and recipe names (backend names are checked against the registry at dispatch)."""
    entries: dict[str, tuple[str, ...]] = {}
    if isinstance(value, str):
        for part in filter(None, (p.strip() for p in value.split(";"))):
            recipe, sep, names = part.rpartition(":")
            recipe = recipe.strip() if sep else "*"
            if recipe in entries:  # the later one silently replaced the earlier
                which = "every recipe (entries without 'recipe:')" if recipe == "*" else f"recipe {recipe!r}"
                raise ConfigError(argument, value, f"one order per recipe, but {which} has two; join them with ','")
            entries[recipe] = _names(names, argument, value)
    elif isinstance(value, Mapping):
        for recipe, names in value.items():
            entries[recipe] = _names(names, argument, value)
    elif isinstance(value, Sequence):
        entries["*"] = _names(value, argument, value)
    else:
        raise ConfigError(argument, value, "a string, a list of backend names or a recipe->names mapping")
    for recipe in entries:
        if recipe != "*" and recipe not in RECIPES:
            raise ConfigError(argument, value, f"unknown recipe {recipe!r}; known: {', '.join(RECIPES)}")
    if not entries:
        raise ConfigError(argument, value, "an order needs at least one backend name")
    return tuple(sorted(entries.items()))


def _names(names: str | Sequence[str], argument: str, whole: Any) -> tuple[str, ...]:
    if not isinstance(names, (str, Sequence)):  # a mapping's value: 3 or a set (no order)
        raise ConfigError(argument, whole, "each recipe's backends as a string or a list of names, in order")
    items = names.split(",") if isinstance(names, str) else list(names)
    cleaned = tuple(n.strip() for n in items if isinstance(n, str) and n.strip())
    if len(cleaned) != len(items) or not cleaned:
        raise ConfigError(argument, whole, "backend names must be non-empty strings")
    for name in cleaned:
        recipe, sep, rest = name.partition("=")
        if sep:
            raise ConfigError(
                argument,
                whole,
                f"{name!r} uses '=': a recipe and its backends are separated by ':', "
                f"e.g. '{recipe.strip()}:{rest.strip()}'",
            )
    return cleaned


def order_for(order: Order | None, recipe: str) -> tuple[str, ...] | None:
    """The names an order gives for ``recipe`` (its own entry, else ``"*"``)."""
    if order is None:
        return None
    mapping = dict(order)
    return mapping.get(recipe, mapping.get("*"))


_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _env_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(name, raw, "a boolean: 1/0, true/false, yes/no, on/off")


def read_env(environ: Mapping[str, str]) -> Settings:
    """Settings from ``GROUPED_GEMM_*`` variables; an invalid value names its variable."""
    values: dict[str, Any] = {}
    raw = environ.get("GROUPED_GEMM_BACKENDS")
    if raw is not None and raw.strip():
        values["backends"] = parse_order(raw, "GROUPED_GEMM_BACKENDS")
    for field, name in (
        ("warn_fallback", "GROUPED_GEMM_WARN_FALLBACK"),
        ("strict", "GROUPED_GEMM_STRICT"),
        ("check_device_splits", "GROUPED_GEMM_CHECK_SPLITS"),
        ("debug", "GROUPED_GEMM_DEBUG"),
        ("autotune", "GROUPED_GEMM_AUTOTUNE"),
    ):
        if name in environ:
            values[field] = _env_bool(name, environ[name])
    level = environ.get("GROUPED_GEMM_LOG_LEVEL")
    if level is not None and level.strip():
        upper = level.strip().upper()
        if upper not in _LEVELS:
            raise ConfigError("GROUPED_GEMM_LOG_LEVEL", level, "DEBUG, INFO, WARNING, ERROR or CRITICAL")
        values["log_level"] = upper
        _show_records_on_stderr()
    return Settings(**values)


def _show_records_on_stderr() -> None:
    """``GROUPED_GEMM_LOG_LEVEL`` promises visible records: without a handler of its own
    (or the application's) the logger would drop DEBUG/INFO records, so attach one."""
    if not LOGGER.handlers:
        handler = logging.StreamHandler()  # stderr
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        LOGGER.addHandler(handler)


def plugin_autoload_disabled() -> bool:
    """``GROUPED_GEMM_DISABLE_PLUGIN_AUTOLOAD``, read when plugins load."""
    raw = os.environ.get("GROUPED_GEMM_DISABLE_PLUGIN_AUTOLOAD")
    return raw is not None and _env_bool("GROUPED_GEMM_DISABLE_PLUGIN_AUTOLOAD", raw)


class _State:
    """Process-wide settings: env (lazily, once) merged with code overrides."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.env: Settings | None = None
        self.code: dict[str, Any] = {}
        self.effective: Settings | None = None
        self.logger_level: int | None = None  # the logger's own level while settings set one

    def current(self) -> Settings:
        effective = self.effective
        if effective is None:
            with self.lock:
                if self.env is None:
                    self.env = read_env(os.environ)
                effective = self.env.model_copy(update=self.code)
                _apply_log_level(effective.log_level)
                self.effective = effective
        return effective


_state = _State()
_listeners: list[Callable[[], None]] = []


def on_change(callback: Callable[[], None]) -> None:
    """Call ``callback`` after every ``configure`` / ``reset_config`` (the dispatcher
    drops its cached routes, which the old settings decided)."""
    _listeners.append(callback)


def _changed() -> None:
    for callback in _listeners:
        callback()


_scopes: contextvars.ContextVar[tuple[Scope, ...]] = contextvars.ContextVar("grouped_gemm_scopes", default=())


def _apply_log_level(level: str | None) -> None:
    """Set the logger's level, or give back the one it had before: without ``log_level``
    (``reset_config``, ``configure(log_level=None)``) the logger kept DEBUG on."""
    if level is not None:
        if _state.logger_level is None:
            _state.logger_level = LOGGER.level
        LOGGER.setLevel(level)
    elif _state.logger_level is not None:
        LOGGER.setLevel(_state.logger_level)
        _state.logger_level = None


def settings() -> Settings:
    """The process-wide settings now in force (environment merged with ``configure``);
    once built, read without ``_State.current``'s frame (calls given device splits ask)."""
    effective = _state.effective
    return effective if effective is not None else _state.current()


def set_in_code(field: str) -> bool:
    """Whether ``configure`` (rather than the environment) set ``field``."""
    return field in _state.code


def configure(**changes: Any) -> Settings:
    """Set process-wide options in code; they override the environment.

    ``backends`` (an order, or None to clear), ``warn_fallback``, ``strict``,
    ``log_level``, ``check_device_splits``, ``debug``, ``autotune``. Flags take ``True`` / ``False``
    only. Returns the settings now in force.
    """
    updates = dict(changes)
    if updates.get("backends") is not None:
        updates["backends"] = parse_order(updates["backends"])
    base = _state.current()
    try:
        validated = Settings.model_validate({**base.model_dump(), **updates})
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "configure"
        value = first.get("input")
        allowed = "True or False (a bool; strings and numbers are rejected)" if first["type"] == "bool_type" else ""
        raise ConfigError(field, value, allowed or first["msg"]) from None
    with _state.lock:
        _state.code = {**_state.code, **{name: getattr(validated, name) for name in updates}}
        _state.effective = None
    _changed()
    return _state.current()


def reset_config() -> Settings:
    """Drop code overrides and re-read the environment."""
    with _state.lock:
        _state.code = {}
        _state.env = None
        _state.effective = None
    _changed()
    return _state.current()


#: The ``use_backends`` frames of this thread / task, outermost first: the context
#: variable's own ``get``, without a Python frame around it (every call asks).
active_scopes: Callable[[], tuple[Scope, ...]] = _scopes.get


@contextlib.contextmanager
def use_backends(
    order: OrderLike | None = None,
    *,
    strict: bool | None = None,
    warn_fallback: bool | None = None,
    debug: bool | None = None,
    autotune: bool | None = None,
) -> Iterator[None]:
    """Prefer backends (and optionally set strict / fallback warnings / debug checks /
    autotune) inside a block.

    Scopes nest; the innermost one with an entry for a call's recipe decides the order.
    They are local to the thread and to the asyncio task.
    """
    flags = (("strict", strict), ("warn_fallback", warn_fallback), ("debug", debug), ("autotune", autotune))
    for name, flag in flags:
        if flag is not None and not isinstance(flag, bool):
            raise ConfigError(name, flag, "True, False or None")
    frame = Scope(
        order=None if order is None else parse_order(order),
        strict=strict,
        warn_fallback=warn_fallback,
        debug=debug,
        autotune=autotune,
    )
    with pushed(_scopes, frame):  # out-of-order exits remove only their own frame
        yield


def _after_fork() -> None:
    _state.lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
