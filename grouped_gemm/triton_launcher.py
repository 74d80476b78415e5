"""Triton launches that skip ``JITFunction.run`` once a specialization is compiled.

Why: ``kernel[grid](...)`` re-binds the arguments, rebuilds Triton's cache key, looks the
kernel up, builds launch metadata and reads knobs on every call; for the one-launch a16w4
route that is a large share of the host time per call (issue 14). ``CachedLauncher`` keeps,
per call signature, the ``CompiledKernel`` that the normal path returned and later calls its
low-level launcher directly, as ``JITFunction.run`` does (same call in Triton 3.6, 3.7, 3.9).

The key refines Triton's own specialization (``native_specialize_impl``), so a cached kernel
is reused only where Triton would pick the same one: per tensor its dtype and whether
``data_ptr() % 16 == 0``; per int whether it is 1, whether ``% 16 == 0``, and its width
(i32 / i64 / u64); bools, floats and None by type; keyword constexprs and options by value;
the current device and Triton's debug / instrumentation knobs. Anything else (interpreter,
launch hooks, pre-run hooks, unknown argument types, missing internals) takes the normal
path. ``GROUPED_GEMM_TRITON_LAUNCHER=triton`` forces the normal path (to measure both).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from triton import knobs

from grouped_gemm.errors import ConfigError

ENV_LAUNCHER = "GROUPED_GEMM_TRITON_LAUNCHER"


def _from_env() -> bool:
    """``cached`` (default) or ``triton``; anything else is a ConfigError naming the variable,
    so a typo does not silently measure the wrong path."""
    value = os.environ.get(ENV_LAUNCHER, "cached").strip().lower()
    if value not in ("cached", "triton"):
        raise ConfigError(ENV_LAUNCHER, value, "'cached' or 'triton'")
    return value == "cached"


#: Whether cached launches are on: the environment (read once) or ``set_enabled``.
_ENABLED = _from_env()
#: Compiled specializations kept per kernel; the oldest goes first (a few per shape class).
MAX_ENTRIES = 64
_I32_MIN, _I32_MAX, _U64_MIN = -(2**31), 2**31 - 1, 2**63


class _Uncacheable(Exception):
    """An argument whose specialization this module does not model."""


def set_enabled(enabled: bool) -> bool:
    """Turn cached launches on or off process-wide (benchmarks); returns the previous value."""
    global _ENABLED
    previous, _ENABLED = _ENABLED, enabled
    return previous


def arg_key(arg: object) -> object:
    """What Triton specializes a runtime argument on, as a hashable value (see module doc)."""
    kind = type(arg)
    if kind is torch.Tensor:
        return (arg.dtype, arg.data_ptr() & 15 == 0)
    if kind is int:
        return (arg == 1, arg & 15 == 0, _I32_MIN <= arg <= _I32_MAX, arg >= _U64_MIN)
    if kind is bool or kind is float or arg is None:
        return kind
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() & 15 == 0)
    raise _Uncacheable(kind.__name__)


def _hooks_set() -> bool:
    """Whether Triton launch or pipeline hooks are installed (a ``HookChain`` with calls, or a
    plain callable): those need Triton's own path, which feeds them launch metadata."""
    runtime = knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return bool(
        getattr(enter, "calls", enter)
        or getattr(leave, "calls", leave)
        or getattr(runtime, "add_stages_inspection_hook", None) is not None
    )


class CachedLauncher:
    """``launcher(grid, *args, **constexprs)`` launches ``kernel[grid](*args, **constexprs)``.

    Runtime arguments go positionally, constexprs and options (``num_warps``) by keyword, as
    at the call sites in this package. ``hits`` / ``misses`` / ``fallbacks`` count calls.
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        params = getattr(kernel, "params", None)
        # Interpreted kernels (no compiled launcher) or unknown internals: Triton's path only.
        self._params = params if hasattr(kernel, "device_caches") and params is not None else None
        self._entries: dict[tuple, tuple] = {}
        self._device: Callable[[], int] | None = None
        self._stream: Callable[[int], int] | None = None
        self.hits = self.misses = self.fallbacks = 0

    def __call__(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        if not _ENABLED or self._params is None or _hooks_set():
            self.fallbacks += 1
            self.kernel[grid](*args, **kwargs)
            return
        if self._device is None:
            from triton.runtime.driver import driver

            self._device, self._stream = driver.active.get_current_device, driver.active.get_current_stream
        device = self._device()
        try:
            options = (device, knobs.runtime.debug, knobs.compilation.instrumentation_mode)
            # Constexprs by value and type: 1, 1.0 and True hash alike but compile apart.
            key = (*options, *map(arg_key, args), *kwargs.items(), *map(type, kwargs.values()))
            entry = self._entries.get(key)
        except (_Uncacheable, TypeError):  # an unmodelled argument, an unhashable constexpr
            self.fallbacks += 1
            self.kernel[grid](*args, **kwargs)
            return
        if entry is None:
            self._compile_and_keep(key, grid, args, kwargs)
            return
        self.hits += 1
        run, function, packed, tail = entry
        size = len(grid)
        run(
            grid[0],
            grid[1] if size > 1 else 1,
            grid[2] if size > 2 else 1,
            self._stream(device),
            function,
            packed,
            None,  # launch metadata: only launch hooks read it, and none are set
            None,
            None,
            *args,
            *tail,
        )

    def _compile_and_keep(self, key: tuple, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> None:
        """Launch through Triton (compiling if needed) and keep what the direct call needs."""
        self.misses += 1
        compiled = self.kernel[grid](*args, **kwargs)
        tail = self._constexpr_tail(len(args), kwargs)
        try:
            entry = (compiled.run, compiled.function, compiled.packed_metadata, tail)
        except AttributeError:  # not a CompiledKernel as this module knows it
            return
        if tail is None or entry[1] is None or getattr(self.kernel, "pre_run_hooks", None):
            return
        if len(self._entries) >= MAX_ENTRIES:
            del self._entries[next(iter(self._entries))]
        self._entries[key] = entry

    def _constexpr_tail(self, positional: int, kwargs: dict[str, Any]) -> tuple | None:
        """The values of the parameters after the positional ones, in signature order, as
        Triton's binder passes them to the launcher (keyword or default); None where that
        cannot be reproduced: a constexpr given positionally (keyed by class, not value), a
        keyword runtime argument, a parameter without value."""
        params = self._params
        if any(p.is_constexpr for p in params[:positional]):
            return None
        tail = []
        for p in params[positional:]:
            if p.name in kwargs:
                if not p.is_constexpr:
                    return None
                tail.append(kwargs[p.name])
            elif p.has_default:
                tail.append(p.default)
            else:
                return None
        return tuple(tail)
