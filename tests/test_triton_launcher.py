"""CachedLauncher: the key refines Triton's specialization, and anything it cannot model
takes Triton's own path.

On the CPU: the key function, the direct call against a stand-in kernel, and the fallbacks
(interpreter, launch hooks, missing internals, the switch). The GPU tests (``pytest -m gpu``)
check bit-identical results against Triton's path for every launch in launch.py, layouts.py
and the core's triton_quantizer.py, cache hits on repeated calls, and CUDA-graph capture
through the cached path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import types

import pytest
import torch
import triton
from triton import knobs
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.runtime.jit import JITFunction, create_function_from_signature
from triton.tools.tensor_descriptor import TensorDescriptor

import grouped_gemm as gg
from grouped_gemm import triton_launcher as launcher
from grouped_gemm.backends.triton_mx import launch, layouts
from grouped_gemm.device import emulated
from grouped_gemm.mx import FORMATS, quantize_mx, quantize_mx_weight, triton_quantizer
from grouped_gemm.triton_launcher import CachedLauncher, int_class, int_classes

NAME = "triton_mxfp4"


# ---- the key ---------------------------------------------------------------------------


def _key(*args, **kwargs) -> tuple:
    """The key of one launch by a launcher shared across the test (signature numbers are per launcher)."""
    return _KEYS.key(0, args, kwargs)


def test_tensor_key_dtype_and_alignment():
    base = torch.zeros(64, dtype=torch.bfloat16)
    assert _key(base) == _key(torch.zeros(64, dtype=torch.bfloat16))
    assert _key(base[1:]) != _key(base)  # 2 bytes off: not 16-aligned
    assert _key(base[8:]) == _key(base)  # 16 bytes off
    assert _key(base.view(torch.int16)) != _key(base)
    assert _key(torch.nn.Parameter(torch.zeros(4))) == _key(torch.zeros(4))  # subclasses too


def test_int_classes():
    keys = {v: int_class(v) for v in (1, 2, 16, 17, 32, 2**31 - 16, 2**31, -16, 2**63)}
    assert keys[1] != keys[17] != keys[16]
    assert keys[16] == keys[32] != keys[17]
    assert keys[2] == keys[17]  # neither 1 nor a multiple of 16: Triton compiles one kernel for both
    assert keys[2**31 - 16] != keys[2**31]  # i32 -> i64
    assert keys[2**31] != keys[2**63]  # i64 -> u64
    assert keys[-16] == keys[16]
    assert _key(2) == _key(17) != _key(16)
    assert int_classes((2, 16)) != int_classes((16, 2))


def test_other_scalars_and_unknowns():
    assert len({_key(True), _key(1), _key(1.5), _key(None)}) == 4
    assert _key(True) == _key(False) and _key(1.5) == _key(2.5)
    with pytest.raises(launcher._Uncacheable):
        _key("a string")


def test_instrumentation_knobs_split(monkeypatch):
    """Triton 3.9's ``JITFunction.run`` passes ``fpsan_homomorphic_casts`` as an option (its
    cache key), read by the fp sanitizer's pass of an instrumented build: keyed there."""
    monkeypatch.setattr(knobs.compilation, "fpsan_homomorphic_casts", False, raising=False)
    plain = _key(torch.zeros(4))
    monkeypatch.setattr(knobs.compilation, "fpsan_homomorphic_casts", True, raising=False)
    assert _key(torch.zeros(4)) == plain  # not instrumented: the same code
    monkeypatch.setattr(knobs.compilation, "instrumentation_mode", "fpsan")
    casts = _key(torch.zeros(4))
    monkeypatch.setattr(knobs.compilation, "fpsan_homomorphic_casts", False, raising=False)
    assert len({plain, casts, _key(torch.zeros(4))}) == 3


def _reference_key(args: tuple, kwargs: dict) -> tuple:
    """The key as first written, one Python call per argument: the fast key must split
    launches exactly as this one does."""

    def one(arg):
        if isinstance(arg, torch.Tensor):
            return (arg.dtype, arg.data_ptr() & 15 == 0)
        if type(arg) is int:
            return int_class(arg)
        return type(arg)

    return (*map(one, args), *kwargs.items(), *map(type, kwargs.values()))


def test_key_splits_launches_as_the_reference_does():
    t = torch.zeros(64)
    h = torch.zeros(64, dtype=torch.float16)
    values = [t, t[1:], t[4:], h, torch.nn.Parameter(t), 1, 2, 16, 2**31, 2**63, True, 1.0, None]
    launches = [((a, b), {"BLOCK": c}) for a in values for b in values for c in (1, True, 1.0, 64)]
    cached = CachedLauncher(_Kernel())
    fast = [cached.key(0, args, kwargs) for args, kwargs in launches]
    slow = [_reference_key(args, kwargs) for args, kwargs in launches]
    for i in range(len(launches)):
        for j in range(i + 1, len(launches)):
            assert (fast[i] == fast[j]) == (slow[i] == slow[j]), (launches[i], launches[j])


def test_int_class_memo_is_bounded(monkeypatch):
    monkeypatch.setattr(launcher, "MAX_INT_TUPLES", 3)
    cached = CachedLauncher(_Kernel())
    for n in range(10):
        cached.key(0, (n,), {})
    assert len(cached._int_classes) <= 3


def _descriptor(source: torch.Tensor, block: list, **fields) -> TensorDescriptor:
    """A descriptor of ``source`` with ``fields`` replaced past its constructor's checks (a
    misaligned base, a bool in the block shape: what Triton's specialization would see)."""
    checked = TensorDescriptor.from_tensor(source, block)
    made = object.__new__(TensorDescriptor)
    made.__dict__.update({f.name: getattr(checked, f.name) for f in dataclasses.fields(checked)}, **fields)
    return made


def _triton_spec(arg) -> tuple:
    return native_specialize_impl(BaseBackend, arg, False, True, True)


def test_descriptor_key_splits_as_triton_specializes():
    """The key of a descriptor launch is equal exactly where the installed Triton's
    specialization is: dtype and block shape (its values' types too) split, the base's
    address and alignment, shape, strides and padding (read per launch) do not."""
    flat = torch.zeros(256 * 256 + 64, dtype=torch.bfloat16)
    a = flat[: 256 * 256].view(256, 256)
    descriptors = [
        TensorDescriptor.from_tensor(a, [64, 64]),
        TensorDescriptor.from_tensor(torch.zeros(256, 256, dtype=torch.bfloat16), [64, 64]),  # another base
        TensorDescriptor.from_tensor(a, (64, 64)),  # a tuple block: Triton lists it
        TensorDescriptor.from_tensor(a, [64, 64], padding="nan"),
        TensorDescriptor.from_tensor(a[:, :128], [64, 64]),  # shape, strides
        TensorDescriptor.from_tensor(flat[8 : 8 + 512 * 64].view(512, 64), [64, 64]),  # 16 bytes on
        _descriptor(a, [64, 64], base=flat[1 : 1 + 256 * 256].view(256, 256)),  # 2 bytes off
        TensorDescriptor.from_tensor(a, [128, 64]),
        TensorDescriptor.from_tensor(a, [64, 128]),
        _descriptor(a, [64, 64], block_shape=[True, 64]),
        TensorDescriptor.from_tensor(a, [1, 64]),
        TensorDescriptor.from_tensor(a.view(4, 64, 256), [1, 64, 64]),
        TensorDescriptor.from_tensor(a.view(torch.float16), [64, 64]),
        TensorDescriptor.from_tensor(a.view(torch.int16), [64, 64]),
        TensorDescriptor.from_tensor(torch.zeros(64, 64), [64, 64]),
    ]
    keys = [_key(d, 32, BLOCK=64) for d in descriptors]
    specs = [_triton_spec(d) for d in descriptors]
    for i in range(len(descriptors)):
        for j in range(i + 1, len(descriptors)):
            assert (keys[i] == keys[j]) == (specs[i] == specs[j]), (specs[i], specs[j])
    assert len(set(keys[:7])) == 1 and len(set(keys)) == len(descriptors) - 6
    assert _key(descriptors[0], 32, BLOCK=64) != _key(descriptors[0], descriptors[0], BLOCK=64)


def test_unmodelled_descriptors_are_uncacheable():
    """A subclass (Triton specializes it as a descriptor, but it may read its fields
    otherwise) and Gluon's descriptor (Triton also keys its layout)."""

    class Subclass(TensorDescriptor):
        pass

    a = torch.zeros(64, 64, dtype=torch.bfloat16)
    gluon = object.__new__(GluonDescriptor)
    for unmodelled in (Subclass(a, a.shape, a.stride(), [64, 64]), gluon):
        with pytest.raises(launcher._Uncacheable):
            _key(unmodelled, 32, BLOCK=64)


def test_binder_passes_descriptors_unchanged():
    """``JITFunction.run`` hands the binder's values to ``compiled.run``: a descriptor comes
    out as the object itself (no conversion the direct call would skip)."""

    def body(A, n, BLOCK: triton.language.constexpr):
        pass

    kernel = JITFunction(body)  # not triton.jit: the compiled form under the interpreter too
    d = TensorDescriptor.from_tensor(torch.zeros(64, 64, dtype=torch.bfloat16), [64, 64])
    binder = create_function_from_signature(kernel.signature, kernel.params, BaseBackend)
    params, specialization, _ = binder(d, 32, BLOCK=64)
    assert params["A"] is d and specialization[0] == _triton_spec(d)


# ---- the direct call, against a stand-in for a JITFunction ------------------------------


class _Compiled:
    """A CompiledKernel's launch surface: ``run`` records what it was called with."""

    def __init__(self, calls: list) -> None:
        self.function, self.packed_metadata = "fn-handle", "packed"
        self.run = lambda *a: calls.append(("direct", a))


class _Kernel:
    """``kernel[grid](...)`` records the normal launch and returns ``compiled``."""

    def __init__(self, compiled_cls=_Compiled) -> None:
        param = lambda name, const, default=None: types.SimpleNamespace(  # noqa: E731
            name=name, is_constexpr=const, has_default=default is not None, default=default
        )
        self.params = [param("x", False), param("n", False), param("BLOCK", True), param("FLAG", True, "dflt")]
        self.device_caches: dict = {}
        self.pre_run_hooks: list = []
        self.calls: list = []
        self.compiled_cls = compiled_cls

    def __getitem__(self, grid):
        def launch_normal(*args, **kwargs):
            self.calls.append(("triton", grid, args, kwargs))
            return self.compiled_cls(self.calls)

        return launch_normal


_KEYS = CachedLauncher(_Kernel())


def _launcher(kernel) -> CachedLauncher:
    cached = CachedLauncher(kernel)
    cached._device, cached._stream = (lambda: 0), (lambda device: 1234)
    return cached


def test_second_call_is_direct_with_constexprs_appended():
    kernel = _Kernel()
    cached = _launcher(kernel)
    x = torch.zeros(32)
    cached((4,), x, 32, BLOCK=64, num_warps=4)
    cached((5, 2), x, 48, BLOCK=64, num_warps=4)
    assert kernel.calls[0][0] == "triton"
    assert kernel.calls[1] == ("direct", (5, 2, 1, 1234, "fn-handle", "packed", None, None, None, x, 48, 64, "dflt"))
    assert (cached.hits, cached.misses, cached.fallbacks) == (1, 1, 0)


def test_bound_constexprs_launch_as_keywords_do():
    """``launch(grid, Constexprs(...), *args)`` passes the same tail as keywords, hits on
    equal constexprs (one interned object), and misses on other values or another class of
    argument; an unbound launch never shares its entries."""
    kernel = _Kernel()
    cached = _launcher(kernel)
    x = torch.zeros(32)
    bound = launcher.Constexprs(BLOCK=64, num_warps=4)
    cached.launch((4,), bound, x, 32)
    cached.launch((5,), bound, x, 48)
    assert kernel.calls[0][:2] == ("triton", (4,)) and kernel.calls[0][3] == {"BLOCK": 64, "num_warps": 4}
    assert kernel.calls[1] == ("direct", (5, 1, 1, 1234, "fn-handle", "packed", None, None, None, x, 48, 64, "dflt"))
    cached.launch((1,), launcher.Constexprs(BLOCK=64, num_warps=4), x, 32)  # equal values: a hit
    cached.launch((1,), launcher.Constexprs(BLOCK=64.0, num_warps=4), x, 32)  # 64.0 compiles apart
    cached.launch((1,), bound, x, 33)  # 33: another int class
    cached.launch((1,), bound.replace(BLOCK=128), x, 32)
    cached((1,), x, 32, BLOCK=64, num_warps=4)  # the same launch unbound
    assert (cached.hits, cached.misses) == (2, 5)
    assert kernel.calls[-2][3] == {"BLOCK": 128, "num_warps": 4}


def test_bound_constexprs_are_interned_read_only_hashable_and_bounded(monkeypatch):
    bound = launcher.Constexprs(BLOCK=64, FLAG=True)
    assert launcher.Constexprs(BLOCK=64, FLAG=True) is bound
    assert launcher.Constexprs(BLOCK=64, FLAG=1) is not bound and launcher.Constexprs(FLAG=True, BLOCK=64) is not bound
    with pytest.raises(TypeError):
        bound.kwargs["BLOCK"] = 128
    with pytest.raises(TypeError):
        launcher.Constexprs(BLOCK=[64])
    monkeypatch.setattr(launcher, "MAX_CONSTEXPRS", 3)
    for block in range(10):
        launcher.Constexprs(BLOCK=block)
    assert len(launcher._CONSTEXPRS) <= 3


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((torch.zeros(33)[1:], 32), {"BLOCK": 64}),  # misaligned pointer
        ((torch.zeros(32), 33), {"BLOCK": 64}),  # int off 16-divisibility
        ((torch.zeros(32), 1), {"BLOCK": 64}),  # int 1 (a constexpr to Triton)
        ((torch.zeros(32), 2**31), {"BLOCK": 64}),  # i64
        ((torch.zeros(32, dtype=torch.float16), 32), {"BLOCK": 64}),  # dtype
        ((torch.zeros(32), 32), {"BLOCK": 128}),  # constexpr value
        ((torch.zeros(32), 32), {"BLOCK": 64.0}),  # constexpr type (64.0 == 64)
        ((torch.zeros(32), 32), {"BLOCK": 64, "num_warps": 8}),  # option
    ],
)
def test_any_specialization_change_misses(args, kwargs):
    kernel = _Kernel()
    cached = _launcher(kernel)
    cached((1,), torch.zeros(32), 32, BLOCK=64)
    cached((1,), *args, **kwargs)
    assert (cached.hits, cached.misses) == (0, 2)
    assert [c[0] for c in kernel.calls] == ["triton", "triton"]


class _OnSecondGpu(torch.Tensor):
    """A CPU tensor that reports GPU 1 as its device, for the device guard."""

    def get_device(self) -> int:
        return 1


class _DeviceRecordingKernel(_Kernel):
    """``_Kernel`` that also records the current device of each normal launch."""

    def __init__(self, current: list[int]) -> None:
        super().__init__()
        self.current, self.launched_on = current, []

    def __getitem__(self, grid):
        self.launched_on.append(self.current[0])
        return super().__getitem__(grid)


@pytest.mark.parametrize("enabled", [True, False])
def test_launch_moves_to_the_tensors_gpu(enabled, monkeypatch):
    """Triton launches on the current device; a tensor on another GPU launches from its own
    (both paths), and the current device is restored after."""
    current, entered = [0], []

    @contextlib.contextmanager
    def on_device(index):
        entered.append(index)
        current[0], before = index, current[0]
        try:
            yield
        finally:
            current[0] = before

    monkeypatch.setattr(launcher, "_current_device", lambda: current[0])
    monkeypatch.setattr(launcher, "_on_device", on_device)
    monkeypatch.setattr(launcher, "_ENABLED", enabled)
    kernel = _DeviceRecordingKernel(current)
    cached = _launcher(kernel)
    cached._device = lambda: current[0]
    x = torch.zeros(32).as_subclass(_OnSecondGpu)
    cached((1,), x, 32, BLOCK=64)
    cached((1,), torch.zeros(32), 32, BLOCK=64)  # a CPU tensor: no guard
    assert entered == [1] and current == [0]
    assert kernel.launched_on == [1, 0] and kernel.calls[0][2][0] is x


def test_missing_internals_fall_back_every_call():
    kernel = _Kernel(compiled_cls=lambda calls: object())  # no run / function / packed_metadata
    cached = _launcher(kernel)
    for _ in range(3):
        cached((1,), torch.zeros(32), 32, BLOCK=64)
    assert [c[0] for c in kernel.calls] == ["triton"] * 3 and cached.hits == 0


def test_not_a_jit_function_falls_back():
    kernel = _Kernel()
    del kernel.device_caches
    cached = _launcher(kernel)
    cached((1,), torch.zeros(32), 32, BLOCK=64)
    cached((1,), torch.zeros(32), 32, BLOCK=64)
    assert cached.fallbacks == 2 and cached.misses == 0


def test_uncacheable_arguments_fall_back():
    kernel = _Kernel()
    cached = _launcher(kernel)
    for _ in range(2):
        cached((1,), torch.zeros(32), "a string", BLOCK=64)  # an argument type the key does not model
        cached((1,), torch.zeros(32), 32, BLOCK=[64])  # an unhashable constexpr
        cached((1,), torch.zeros(32), 32, 64)  # a constexpr given positionally
        cached((1,), object.__new__(GluonDescriptor), 32, BLOCK=64)  # a descriptor not modelled
    assert cached.hits == 0 and all(c[0] == "triton" for c in kernel.calls)


def test_descriptor_launch_is_direct_with_the_object():
    """A descriptor launch hits on a second descriptor of the same specialization (another
    base, padding) and passes that object on, as Triton's launcher builds its CUtensorMap
    per call; another block shape misses."""
    kernel = _Kernel()
    cached = _launcher(kernel)
    a, b = torch.zeros(256, 64, dtype=torch.bfloat16), torch.zeros(128, 64, dtype=torch.bfloat16)
    cached((1,), TensorDescriptor.from_tensor(a, [64, 64]), 32, BLOCK=64)
    other = TensorDescriptor.from_tensor(b, [64, 64], padding="nan")
    cached((2,), other, 32, BLOCK=64)
    assert kernel.calls[1] == (
        "direct",
        (2, 1, 1, 1234, "fn-handle", "packed", None, None, None, other, 32, 64, "dflt"),
    )
    cached((1,), TensorDescriptor.from_tensor(a, [128, 64]), 32, BLOCK=64)
    assert (cached.hits, cached.misses, cached.fallbacks) == (1, 2, 0)


def test_launch_hooks_take_triton_path():
    kernel = _Kernel()
    cached = _launcher(kernel)
    cached((1,), torch.zeros(32), 32, BLOCK=64)
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        cached((1,), torch.zeros(32), 32, BLOCK=64)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    cached((1,), torch.zeros(32), 32, BLOCK=64)
    assert [c[0] for c in kernel.calls] == ["triton", "triton", "direct"]


def test_switch_forces_triton_path():
    kernel = _Kernel()
    cached = _launcher(kernel)
    previous = launcher.set_enabled(False)
    try:
        cached((1,), torch.zeros(32), 32, BLOCK=64)
        cached((1,), torch.zeros(32), 32, BLOCK=64)
    finally:
        launcher.set_enabled(previous)
    assert cached.fallbacks == 2 and [c[0] for c in kernel.calls] == ["triton", "triton"]


def test_env_switch(monkeypatch):
    monkeypatch.setenv(launcher.ENV_LAUNCHER, "Triton")
    assert launcher._from_env() is False
    monkeypatch.setenv(launcher.ENV_LAUNCHER, "cached")
    assert launcher._from_env() is True
    monkeypatch.setenv(launcher.ENV_LAUNCHER, "off")
    with pytest.raises(gg.ConfigError, match=launcher.ENV_LAUNCHER):
        launcher._from_env()
    monkeypatch.setenv(launcher.ENV_LAUNCHER, " ")  # empty means unset, as for every other variable
    assert launcher._from_env() is True


def test_a_bad_env_value_fails_the_first_launch_not_the_import():
    # Read at import, a typo made `import grouped_gemm` itself fail, also where no Triton
    # kernel ever launches (every CPU call).
    code = (
        "import torch, grouped_gemm as gg\n"
        "print(gg.grouped_gemm(torch.ones(4, 2), torch.ones(1, 3, 2), [4], backend='reference').sum().item())\n"
        "from grouped_gemm import triton_launcher as launcher\n"
        "try:\n"
        "    launcher.set_enabled(True)\n"
        "except gg.ConfigError as exc:\n"
        "    print(type(exc).__name__, exc.argument)\n"
    )
    env = {**os.environ, launcher.ENV_LAUNCHER: "cahced"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["24.0", "ConfigError", launcher.ENV_LAUNCHER]


def test_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(launcher, "MAX_ENTRIES", 2)
    cached = _launcher(_Kernel())
    for block in (16, 32, 64):
        cached((1,), torch.zeros(32), 32, BLOCK=block)
    assert len(cached._entries) == 2


@pytest.mark.skipif(not launch.interpreted(), reason="runs the kernel in Triton's interpreter")
def test_interpreter_takes_triton_path_and_stays_correct(gen):
    """Under TRITON_INTERPRET=1 the launchers in launch.py use Triton's path, results unchanged."""
    x = torch.randn(8, 64, generator=gen)
    before = launch._QUANTIZE_DECODE.fallbacks
    got = launch.quantize_decode(x, "e4m3", "rceil")
    assert launch._QUANTIZE_DECODE.fallbacks == before + 1 and launch._QUANTIZE_DECODE.hits == 0
    want = quantize_mx(x, "e4m3", axis=-1).dequantize(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.skipif(not launch.interpreted(), reason="runs the kernel in Triton's interpreter")
def test_interpreter_quantizer_takes_triton_path(gen):
    """The core quantizer's launches go through CachedLauncher too (Triton's path here)."""
    x = torch.randn(64, 64, generator=gen)
    before = triton_quantizer._QUANTIZE_LAST.fallbacks, triton_quantizer._QUANTIZE_STRIDED.fallbacks
    for axis in (-1, 0):
        got = triton_quantizer.quantize(x, FORMATS["e4m3"], axis % 2, "rceil", 32, 0)
        want = quantize_mx(x, "e4m3", axis=axis)
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scale, want.scale)
    after = triton_quantizer._QUANTIZE_LAST.fallbacks, triton_quantizer._QUANTIZE_STRIDED.fallbacks
    assert after == (before[0] + 1, before[1] + 1)


# ---- GPU: the cached path against Triton's -----------------------------------------------

LAUNCHERS = (
    launch._UPCAST,
    launch._SCALED,
    launch._QUANTIZE_DECODE,
    launch._DEQUANT,
    launch._WGRAD,
    launch._GROUPED,
    layouts._MX_UPCAST,
    layouts._QUANTIZE_UPCAST,
    triton_quantizer._QUANTIZE_LAST,
    triton_quantizer._QUANTIZE_STRIDED,
)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _both_paths(fn):
    """fn() through Triton's path, then twice through the cached one (a miss, then a hit):
    the three results bit-identical; returns the hits the repeat added."""
    previous = launcher.set_enabled(False)
    try:
        want = fn()
    finally:
        launcher.set_enabled(previous)
    launcher.set_enabled(True)
    try:
        first = fn()
        hits = sum(c.hits for c in LAUNCHERS)
        second = fn()
        added = sum(c.hits for c in LAUNCHERS) - hits
    finally:
        launcher.set_enabled(previous)
    torch.cuda.synchronize()
    _same(first, want)
    _same(second, want)
    return added


def _gemm(op, a, b, splits, recipe):
    with gg.use_backends(NAME, strict=True):
        if op == "fwd":
            return gg.grouped_gemm(a, b, splits, recipe=recipe, out_dtype=torch.float32)
        if op == "dgrad":
            return gg.grouped_gemm_dgrad(a, b, splits, recipe=recipe, out_dtype=torch.float32)
        return gg.grouped_gemm_wgrad(a, b, splits, recipe=recipe, out_dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["upcast", "dot_scaled"])
@pytest.mark.parametrize("recipe", ["mxfp4", "a8w4", "a16w4"])
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize(("m", "offset"), [(256, 0), (257, 0), (33, 1), (4096, 1)])
def test_gpu_cached_equals_triton_path(op, recipe, path, m, offset, gen):
    """Every route's launches, over sizes on both sides of 16-divisibility and activations
    that start 2 bytes past an aligned address (misaligned views)."""
    if op == "wgrad" and recipe == "a16w4":
        pytest.skip("a16w4's wgrad is bf16 x bf16: torch_grouped_mm runs it")
    device = torch.device("cuda")
    groups, n, k = 8, 512, 768
    splits = torch.tensor(gg.skewed_splits(groups, m), device=device)
    act = torch.bfloat16 if recipe == "a16w4" else torch.float32
    cols = {"fwd": k, "dgrad": n, "wgrad": n}[op]
    a = torch.randn(m * cols + offset, generator=gen).to(device, act)[offset:].view(m, cols)
    b = (
        torch.randn(m, k, generator=gen).to(device)
        if op == "wgrad"
        else torch.randn(groups, n, k, generator=gen).to(device)
    )
    arch = "sm_100" if path == "dot_scaled" else None
    with emulated(arch, "cuda") if arch else contextlib.nullcontext():
        hits = _both_paths(lambda: _gemm(op, a, b, splits, recipe))
    assert hits >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [64, 65, 1000])
def test_gpu_decode_and_layout_launches(rows, gen):
    device = torch.device("cuda")
    x = torch.randn(rows, 256, generator=gen).to(device, torch.bfloat16)
    assert _both_paths(lambda: launch.quantize_decode(x, "e4m3", "rceil")) == 1
    assert _both_paths(lambda: quantize_mx(x, "e4m3", axis=-1).data) == 1  # the core quantizer's launches
    if rows % 32 == 0:
        assert _both_paths(lambda: quantize_mx(x, "e2m1", axis=0).data) == 1
    t = quantize_mx(x, "e2m1", axis=0 if rows % 32 == 0 else 1)
    assert _both_paths(lambda: launch.dequantize(t)) == 1
    w = torch.randn(4, 256, 512, generator=gen).to(device, torch.bfloat16)
    assert _both_paths(lambda: layouts.quantize_upcast_weight(w, "fwd", "rceil").data) == 1
    w_mx = quantize_mx_weight(w, "e2m1")
    assert _both_paths(lambda: layouts.build_upcast_weight(w_mx).data) == 1


def _hit_with_descriptors(cached: CachedLauncher, fn, monkeypatch) -> torch.Tensor:
    """fn() through Triton's path, then twice through the cached one: the second call is a
    hit of ``cached`` whose arguments held tensor descriptors, and bit-identical to the first."""
    previous = launcher.set_enabled(False)
    try:
        want = fn()
    finally:
        launcher.set_enabled(previous)
    keyed = []
    key = cached.key
    monkeypatch.setattr(cached, "key", lambda device, args, *rest: keyed.append(args) or key(device, args, *rest))
    launcher.set_enabled(True)
    try:
        fn()  # compiles (or finds Triton's kernel) and keeps it
        hits, fallbacks = cached.hits, cached.fallbacks
        got = fn()
    finally:
        launcher.set_enabled(previous)
    torch.cuda.synchronize()
    assert cached.hits == hits + 1 and cached.fallbacks == fallbacks
    assert any(isinstance(arg, TensorDescriptor) for arg in keyed[-1])
    _same(got, want)
    return got


@pytest.mark.gpu
def test_gpu_tma_upcast_launch_hits(gen, monkeypatch):
    """a16w4 with 256-row groups takes the upcast kernel's TMA tile (activations through
    descriptors): its second call is a cached hit, bit-identical to Triton's path."""
    device = torch.device("cuda")
    groups, rows, n, k = 4, 256, 256, 256
    assert launch.upcast_config(groups * rows, groups).tma
    x = torch.randn(groups * rows, k, generator=gen).to(device, torch.bfloat16)
    w = quantize_mx_weight(torch.randn(groups, n, k, generator=gen).to(device), "e2m1")
    splits = torch.tensor([rows] * groups, device=device)
    _hit_with_descriptors(launch._UPCAST, lambda: _gemm("fwd", x, w, splits, "a16w4"), monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("transpose_w", [True, False], ids=["fwd", "dgrad"])
def test_gpu_tma_grouped_launch_hits(transpose_w, gen, monkeypatch):
    """The plain grouped kernel's TMA tile (both operands through descriptors), likewise."""
    device = torch.device("cuda")
    groups, rows, n, k = 4, 256, 256, 256
    assert launch.grouped_config(groups * rows, groups).tma
    a = torch.randn(groups * rows, k, generator=gen).to(device, torch.bfloat16)
    w = torch.randn(groups, n, k, generator=gen).to(device, torch.bfloat16)
    splits = torch.tensor([rows] * groups, device=device, dtype=torch.int32)

    def call():
        out = torch.empty(groups * rows, n if transpose_w else k, device=device)
        return launch.launch_grouped(a, w, splits, out, transpose_w=transpose_w)

    _hit_with_descriptors(launch._GROUPED, call, monkeypatch)


@pytest.mark.gpu
def test_gpu_cuda_graph_through_cached_path(gen):
    """Captured on torch's side stream: the cached path reads the current stream per call.
    50 rows a group: a tile without TMA (the TMA tiles' hits: the tests above)."""
    device = torch.device("cuda")
    groups, m, n, k = 8, 400, 512, 1024
    assert not launch.upcast_config(m, groups).tma
    splits = torch.tensor(gg.skewed_splits(groups, m), device=device)
    x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
    w = quantize_mx_weight(torch.randn(groups, n, k, generator=gen).to(device), "e2m1")
    out = torch.empty(m, n, device=device)

    def call():
        with gg.use_backends(NAME, strict=True):
            return gg.grouped_gemm(x, w, splits, recipe="a16w4", out=out, out_dtype=torch.float32)

    previous = launcher.set_enabled(True)
    try:
        want = call().clone()  # compiles, fills the cache and the layout cache
        call()
        hits = launch._UPCAST.hits
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        assert launch._UPCAST.hits > hits
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
    finally:
        launcher.set_enabled(previous)
    _same(out, want)


def test_host_grid_arithmetic_matches_triton():
    """The host copies of ``triton.cdiv`` / ``triton.next_power_of_2`` (``cdiv``'s
    docstring: Triton's are constexpr functions, slow to call on the host) agree with them."""
    values = [*range(-3, 300), 2**31 - 1, 2**31, 2**32 + 5, 2**63 - 1, 2**63, 2**64 - 1]
    for n in values:
        assert launcher.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 32, 128, 1000):
            assert launcher.cdiv(n, d) == triton.cdiv(n, d), (n, d)
