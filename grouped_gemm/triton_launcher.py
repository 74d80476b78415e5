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
the current device and Triton's debug / instrumentation knobs (with 3.9's
``fpsan_homomorphic_casts``, an option ``JITFunction.run`` adds, where instrumented).

Host ``TensorDescriptor`` arguments (``triton.tools.tensor_descriptor``; the TMA launches):
per descriptor its base's dtype and its block shape, all that Triton 3.6.0, 3.7.1 and 3.9
specialize on (``native_specialize_impl`` gives ``tensordesc<bf16[128, 64]>``; the tests
check the key against it). The rest is read per launch by the compiled kernel's ``run`` in
all three: the NVIDIA launcher builds the CUtensorMap from the descriptor object each call
(base pointer, shape, strides, ``padding``, 3.7+'s ``round_f32_to_tf32``), and the binder
hands the object over unchanged, so the direct call passes what ``JITFunction.run`` would.
Not keyed, as Triton does not: the base's alignment (the descriptor asserts 16 bytes).
Subclasses and Gluon's descriptor (whose layout Triton also keys) are not modelled.

Anything else (interpreter, launch hooks, pre-run hooks, unknown argument types, missing
internals) takes the normal path. ``GROUPED_GEMM_TRITON_LAUNCHER=triton`` forces the normal
path (to measure both). Either way, a launch whose tensors live on another GPU than the
current one switches to theirs first, as torch's own ops do (Triton launches on the current
device).

The key is built per call, so it is kept cheap (``CachedLauncher.key``). Dev CPU numbers
(2-core AMD EPYC VM, Python 3.11, no GPU; a stand-in kernel shaped like the upcast launch:
5 tensors, 10 ints, 12 keywords; ``benchmarks/launcher_key.py``), first per-argument
version -> now: key 3.95 -> 2.74 us, key and cache lookup 4.95 -> 3.19 us, whole cached
call with a no-op launch 6.94 -> 5.20 us. Most of what is left is reading each tensor's
dtype and data pointer (~0.9 us for 5 tensors) and the keyword constexprs (~0.5 us).
"""

from __future__ import annotations

import contextlib
import os
import threading
import types
from collections.abc import Callable, Mapping
from operator import itemgetter
from typing import Any

import torch
from triton import knobs
from triton.runtime.interpreter import InterpretedFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from grouped_gemm.errors import ConfigError

ENV_LAUNCHER = "GROUPED_GEMM_TRITON_LAUNCHER"


def _from_env() -> bool:
    """``cached`` (default, also when unset or empty, as for the other variables) or
    ``triton``; anything else is a ConfigError naming the variable, so a typo does not
    silently measure the wrong path."""
    value = os.environ.get(ENV_LAUNCHER, "").strip().lower() or "cached"
    if value not in ("cached", "triton"):
        raise ConfigError(ENV_LAUNCHER, value, "'cached' or 'triton'")
    return value == "cached"


#: Whether cached launches are on: the environment (read at the first launch, not at
#: import: a bad value must fail the call that uses it, not ``import grouped_gemm``, as
#: every other variable does) or ``set_enabled``. None until then.
_ENABLED: bool | None = None


def _enabled() -> bool:
    """``_ENABLED``, reading the environment on first use."""
    global _ENABLED
    if _ENABLED is None:
        _ENABLED = _from_env()
    return _ENABLED


#: Compiled specializations kept per kernel; the oldest goes first (a few per shape class).
MAX_ENTRIES = 64
#: Int-argument tuples whose classes are remembered per kernel (cleared when full).
MAX_INT_TUPLES = 4096
_I32_MIN, _I32_MAX, _U64_MIN = -(2**31), 2**31 - 1, 2**63


def cdiv(x: int, y: int) -> int:
    """``triton.cdiv`` for host code: Triton 3.5+ wraps it as a ``constexpr_function``, whose
    call costs ~2 us on the host (dev CPU) against ~0.05 us here; same formula."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for host code (see ``cdiv``): the same value for every
    n below 2**64 (0 for n <= 0)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


class _Uncacheable(Exception):
    """An argument whose specialization this module does not model."""


def set_enabled(enabled: bool) -> bool:
    """Turn cached launches on or off process-wide (benchmarks); returns the previous value."""
    global _ENABLED
    previous, _ENABLED = _enabled(), enabled
    return previous


def int_class(value: int) -> int:
    """What Triton specializes an int on, as 4 bits: == 1, % 16 == 0, fits i32, needs u64."""
    return (value == 1) | (value & 15 == 0) << 1 | (_I32_MIN <= value <= _I32_MAX) << 2 | (value >= _U64_MIN) << 3


def int_classes(values: tuple[int, ...]) -> int:
    """The classes of a fixed number of ints packed into one int (4 bits each): one
    hashable value, so the key does not hash a tuple per int."""
    packed = 0
    for value in reversed(values):
        packed = packed << 4 | int_class(value)
    return packed


def _picker(positions: tuple[int, ...]) -> Callable[[tuple], tuple]:
    """``args -> tuple(args[i] for i in positions)`` in C (``itemgetter`` unwraps one item)."""
    if len(positions) == 1:
        (only,) = positions
        return lambda args: (args[only],)
    return itemgetter(*positions) if positions else lambda args: ()


#: Per tuple of argument types: its signature number, then pickers of its tensors, ints and
#: tensor descriptors (None where it has none: most launches, which then skip the call).
_Plan = tuple[int, Callable[[tuple], tuple], Callable[[tuple], tuple], Callable[[tuple], tuple] | None]


def _signature(kinds: tuple[type, ...]) -> tuple[type, ...]:
    """The types as Triton specializes on them (tensor subclasses as ``torch.Tensor``);
    _Uncacheable for a type not modelled."""
    signature = []
    for kind in kinds:
        if issubclass(kind, torch.Tensor):
            kind = torch.Tensor
        elif kind not in (int, bool, float, type(None), TensorDescriptor):  # exact: no subclasses
            raise _Uncacheable(kind.__name__)
        signature.append(kind)
    return tuple(signature)


def _descriptor_classes(descriptors: tuple) -> list[tuple]:
    """What Triton specializes a host ``TensorDescriptor`` on (module doc): its base's dtype
    and its block shape, the shape's values with their types (``[True, 64]`` and ``[1, 64]``
    are equal tuples but spell apart in Triton's ``tensordesc<bf16[1, 64]>``)."""
    return [(d.base.dtype, tuple(d.block_shape), *map(type, d.block_shape)) for d in descriptors]


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


def _gpu_index(args: tuple) -> int:
    """The GPU index of the launch's first tensor argument; -1 for a CPU tensor or none."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.get_device()
    return -1


def _current_device() -> int:
    return torch._C._cuda_getDevice()


def _on_device(index: int) -> Any:
    return torch.cuda.device(index)


class Constexprs:
    """Keyword constexprs and options fixed once, by a launch plan that is itself looked up
    (``CachedLauncher.launch``): the cached path keys on the object instead of reading,
    hashing and comparing each of a dozen values every call (~1.2 us a launch on the dev
    CPU, issue 14). Interned: equal values (by name, value and type, as the per-call key
    compares them) give one object, so plans that differ only in what the kernel does not
    see (another M of a shape, say) share launcher entries. Read-only (``kwargs`` is a view
    of a private copy); values must be hashable, as the per-call key needs them to be."""

    __slots__ = ("kwargs",)
    kwargs: Mapping[str, Any]

    def __new__(cls, **kwargs: Any) -> Constexprs:
        identity = _by_value(kwargs)
        found = _CONSTEXPRS.get(identity)  # TypeError for an unhashable value, here rather than at a launch
        if found is None:
            if len(_CONSTEXPRS) >= MAX_CONSTEXPRS:
                _CONSTEXPRS.clear()  # bounded; a dropped object only makes its launches miss once
            found = _CONSTEXPRS[identity] = super().__new__(cls)
            found.kwargs = types.MappingProxyType(kwargs)
        return found

    def replace(self, **changes: Any) -> Constexprs:
        """``self`` with ``changes`` applied (a plan's variant, e.g. without TMA)."""
        return Constexprs(**{**self.kwargs, **changes})


def _by_value(kwargs: Mapping[str, Any]) -> tuple:
    """Constexprs as Triton tells them apart: by name, value and type (1, 1.0 and True hash
    alike but compile apart), flat: the launch key's tail and an interned object's identity."""
    values = kwargs.values()
    return (*kwargs, *values, *map(type, values))


#: Interned ``Constexprs`` by their values; at most ``MAX_CONSTEXPRS`` (cleared when full).
_CONSTEXPRS: dict[tuple, Constexprs] = {}
MAX_CONSTEXPRS = 1024


#: Triton's interpreter swaps ``triton.language``'s functions for its own while a kernel
#: runs and puts them back after: two threads interpreting at once break each other
#: ("Did you forget to add @triton.jit ?"). Interpreted launches take turns.
_interpreter_lock = threading.Lock()


def _after_fork() -> None:
    # A thread of the parent may have held the lock at fork; the child has no such thread.
    global _interpreter_lock
    _interpreter_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


class CachedLauncher:
    """``launcher(grid, *args, **constexprs)`` launches ``kernel[grid](*args, **constexprs)``;
    ``launcher.launch(grid, constexprs, *args)`` the same with a ``Constexprs``.

    Runtime arguments go positionally, constexprs and options (``num_warps``) by keyword, as
    at the call sites in this package. ``hits`` / ``misses`` / ``fallbacks`` count calls.
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        params = getattr(kernel, "params", None)
        # Interpreted kernels (no compiled launcher) or unknown internals: Triton's path only.
        self._params = params if hasattr(kernel, "device_caches") and params is not None else None
        self._interpreted = isinstance(kernel, InterpretedFunction)
        self._entries: dict[tuple, tuple] = {}
        self._plans: dict[tuple[type, ...], _Plan] = {}
        self._signatures: dict[tuple[type, ...], int] = {}  # numbers stay fixed: keys hold them
        self._int_classes: dict[tuple[int, ...], int] = {}
        self._device: Callable[[], int] | None = None
        self._stream: Callable[[int], int] | None = None
        self.hits = self.misses = self.fallbacks = 0

    def __call__(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        self._run(grid, args, kwargs, None)

    def launch(self, grid: tuple[int, ...], constexprs: Constexprs, *args: Any) -> None:
        """``self(grid, *args, **constexprs.kwargs)``, keyed on ``constexprs`` itself."""
        self._run(grid, args, constexprs.kwargs, constexprs)

    def _run(self, grid: tuple[int, ...], args: tuple, kwargs: Mapping[str, Any], bound: Constexprs | None) -> None:
        index = _gpu_index(args)
        if index >= 0 and index != _current_device():
            # Triton launches on the current device: tensors on another GPU of the process
            # (layers spread over GPUs, as with a device map) launch from their own.
            with _on_device(index):
                self._run(grid, args, kwargs, bound)
            return
        if not (_ENABLED if _ENABLED is not None else _enabled()) or self._params is None or _hooks_set():
            self.fallbacks += 1
            with _interpreter_lock if self._interpreted else contextlib.nullcontext():
                self.kernel[grid](*args, **kwargs)
            return
        if self._device is None:
            from triton.runtime.driver import driver

            self._device, self._stream = driver.active.get_current_device, driver.active.get_current_stream
        # A GPU tensor's index is the current device by now (the switch above): no second query.
        device = index if index >= 0 else self._device()
        try:
            key = self.key(device, args, kwargs, bound)
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

    def _plan(self, kinds: tuple[type, ...]) -> _Plan:
        signature = _signature(kinds)
        number = self._signatures.setdefault(signature, len(self._signatures))
        tensors = tuple(i for i, kind in enumerate(signature) if kind is torch.Tensor)
        descriptors = tuple(i for i, kind in enumerate(signature) if kind is TensorDescriptor)
        ints = _picker(tuple(i for i, kind in enumerate(signature) if kind is int))
        return number, _picker(tensors), ints, _picker(descriptors) if descriptors else None

    def key(self, device: int, args: tuple, kwargs: Mapping[str, Any], bound: Constexprs | None = None) -> tuple:
        """What Triton specializes this launch on (module doc), as one flat hashable tuple;
        _Uncacheable for an argument type not modelled.

        Cheap to build and hash (numbers in the module doc): the argument types pick a plan
        (tensor and int positions) and a signature number, kept per type tuple; the ints'
        classes are packed into one int, kept per tuple of int values (strides and sizes
        repeat from call to call); only the tensors are read on every call. ``bound``, the
        ``Constexprs`` that ``kwargs`` come from, stands for them (compared by identity:
        never equal to what an unbound launch puts in its place).
        """
        kinds = tuple(map(type, args))
        plan = self._plans.get(kinds)
        if plan is None:
            plan = self._plans[kinds] = self._plan(kinds)
        number, tensors, ints_of, descriptors = plan
        ints = ints_of(args)  # exact ints by the plan: equal tuples, equal classes
        classes = self._int_classes.get(ints)
        if classes is None:
            if len(self._int_classes) >= MAX_INT_TUPLES:
                self._int_classes.clear()
            classes = self._int_classes[ints] = int_classes(ints)
        if bound is not None:
            constexprs: tuple = (bound,)
        else:  # the signature fixes the tensors' count, so the flat tail is unambiguous
            constexprs = _by_value(kwargs)
        mode = knobs.compilation.instrumentation_mode
        return (
            device,
            knobs.runtime.debug,
            # 3.9 also passes the fp sanitizer's cast knob as an option; only an
            # instrumented build reads it (absent before 3.9: None).
            mode and (mode, getattr(knobs.compilation, "fpsan_homomorphic_casts", None)),
            number,
            classes,
            *[(t.dtype, t.data_ptr() & 15 == 0) for t in tensors(args)],
            *(_descriptor_classes(descriptors(args)) if descriptors else ()),
            *constexprs,
        )

    def _compile_and_keep(self, key: tuple, grid: tuple[int, ...], args: tuple, kwargs: Mapping[str, Any]) -> None:
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

    def _constexpr_tail(self, positional: int, kwargs: Mapping[str, Any]) -> tuple | None:
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
