"""DeviceInfo: what the chip under a call is and can do.

Detected once per torch device: a call routes by the chip under its tensors. A chip can
also be described (``DeviceInfo.for_arch``, ``use_device``) to ask what would run there
("what would run on gfx950?") with ``explain`` / ``describe_problem`` on any machine; a
description never changes what a call on real tensors runs. Tests that must run another
chip's code path on this machine's tensors (Triton's CPU interpreter down gfx950's
``dot_scaled`` path) say so with ``emulated``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import platform
import threading
from collections.abc import Callable, Iterator
from typing import Literal

import torch

from grouped_gemm.errors import InvalidArgumentError
from grouped_gemm.scope_stack import pushed

Vendor = Literal["cpu", "cuda", "rocm"]

#: Capability flags a backend may ask for.
#: ``bf16``: bf16 matrix math; ``fp8``: OCP fp8 (e4m3fn/e5m2) matrix math;
#: ``wgmma``: Hopper warpgroup MMA; ``scaled_mma``: hardware MX block-scaled MMA
#: (what ``tl.dot_scaled`` lowers to natively); ``tma``: bulk tensor copies.
CAPABILITIES = ("bf16", "fp8", "wgmma", "scaled_mma", "tma")

# Per-arch facts. Sources: CUDA programming guide compute-capability tables (sm_89 adds
# fp8, sm_90 wgmma/TMA, sm_100 and sm_120 block-scaled MMA); AMD CDNA3/CDNA4 ISA guides
# (gfx942 has only the fnuz fp8 variants, gfx950 adds OCP fp8 and scaled MFMA).
_ARCH_TABLE: dict[str, tuple[Vendor, int, frozenset[str]]] = {
    "cpu": ("cpu", os.cpu_count() or 1, frozenset({"bf16"})),
    "sm_80": ("cuda", 108, frozenset({"bf16"})),
    "sm_86": ("cuda", 84, frozenset({"bf16"})),
    "sm_89": ("cuda", 128, frozenset({"bf16", "fp8"})),
    "sm_90": ("cuda", 132, frozenset({"bf16", "fp8", "wgmma", "tma"})),
    "sm_100": ("cuda", 148, frozenset({"bf16", "fp8", "scaled_mma", "tma"})),
    "sm_103": ("cuda", 148, frozenset({"bf16", "fp8", "scaled_mma", "tma"})),
    "sm_120": ("cuda", 170, frozenset({"bf16", "fp8", "scaled_mma", "tma"})),
    "gfx90a": ("rocm", 104, frozenset({"bf16"})),
    "gfx942": ("rocm", 304, frozenset({"bf16"})),
    "gfx950": ("rocm", 256, frozenset({"bf16", "fp8", "scaled_mma"})),
}


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceInfo:
    """The chip a problem runs on, as dispatch sees it.

    ``arch`` is ``cpu``, ``sm_XY`` (NVIDIA compute capability X.Y) or a ROCm gfx name;
    ``multiprocessors`` is the SM (NVIDIA) or CU (AMD) count, or CPU cores;
    ``detected`` is False for a described (overridden) device.
    """

    vendor: Vendor
    arch: str
    name: str
    multiprocessors: int
    capabilities: frozenset[str]
    detected: bool = True

    def has(self, capability: str) -> bool:
        """Whether the chip has a capability flag (see ``CAPABILITIES``)."""
        return capability in self.capabilities

    @classmethod
    def for_arch(cls, arch: str, *, multiprocessors: int | None = None, name: str | None = None) -> DeviceInfo:
        """A described device of a known arch, for ``explain`` and for tests; ``multiprocessors``
        and ``name`` default to the arch's flagship chip."""
        key = arch.lower() if isinstance(arch, str) else None
        if key not in _ARCH_TABLE:
            raise InvalidArgumentError("arch", arch, f"known archs are {', '.join(sorted(_ARCH_TABLE))}")
        if multiprocessors is not None and (
            not isinstance(multiprocessors, int) or isinstance(multiprocessors, bool) or multiprocessors < 1
        ):
            raise InvalidArgumentError("multiprocessors", multiprocessors, "a positive integer (SMs or CUs), or None")
        if name is not None and not isinstance(name, str):
            raise InvalidArgumentError("name", name, "a string, or None")
        vendor, units, caps = _ARCH_TABLE[key]
        return cls(
            vendor=vendor,
            arch=key,
            name=name or f"described {key}",
            multiprocessors=multiprocessors or units,
            capabilities=caps,
            detected=False,
        )

    def __str__(self) -> str:
        origin = "" if self.detected else " (described)"
        return f"{self.name} [{self.vendor} {self.arch}, {self.multiprocessors} units]{origin}"


def known_archs() -> tuple[str, ...]:
    """The arch names ``DeviceInfo.for_arch`` accepts."""
    return tuple(sorted(_ARCH_TABLE))


_detected: dict[torch.device, DeviceInfo] = {}
_detect_lock = threading.Lock()
#: The ``use_device`` scopes in force, innermost last; each a one-item list, so that a scope
#: removes its own frame by identity even where two scopes name the same chip.
_described: contextvars.ContextVar[tuple[list[DeviceInfo], ...]] = contextvars.ContextVar(
    "grouped_gemm_described_device", default=()
)
_listeners: list[Callable[[], None]] = []
#: Per torch device, the ``emulated`` scopes in force, innermost last; each a one-item list,
#: told apart by identity. Kept apart from ``_detected``, so no scope has anything to restore.
_emulations: dict[torch.device, tuple[list[DeviceInfo], ...]] = {}


def device_info(device: torch.device) -> DeviceInfo:
    """The chip under a torch device, detected once (or as ``emulated`` says)."""
    emulations = _emulations.get(device)
    if emulations:
        return emulations[-1][0]
    info = _detected.get(device)
    if info is None:
        with _detect_lock:
            info = _detected.get(device) or _detect(device)
            _detected[device] = info
    return info


def described_device(device: DeviceInfo | str | None = None) -> DeviceInfo:
    """The chip a described problem is for: ``device`` (a DeviceInfo or an arch name), else
    the innermost ``use_device``, else this machine's current device."""
    if isinstance(device, DeviceInfo):
        return device
    if isinstance(device, str):
        return DeviceInfo.for_arch(device)
    if device is not None:  # not silently this machine's chip
        raise InvalidArgumentError("device", device, "a DeviceInfo, an arch name such as 'sm_90', or None")
    scopes = _described.get()
    return scopes[-1][0] if scopes else device_info(_current_device())


def _current_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def on_change(callback: Callable[[], None]) -> None:
    """Call ``callback`` whenever ``emulated`` changes what a torch device is detected as
    (the dispatcher drops the routes it decided for the old chip)."""
    _listeners.append(callback)


def _detect(device: torch.device) -> DeviceInfo:
    if device.type != "cuda":
        return DeviceInfo(
            vendor="cpu",
            arch="cpu",
            name=platform.processor() or platform.machine() or "cpu",
            multiprocessors=os.cpu_count() or 1,
            capabilities=_ARCH_TABLE["cpu"][2],
        )
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip:
        arch = props.gcnArchName.split(":")[0]
        vendor: Vendor = "rocm"
    else:
        arch = f"sm_{props.major}{props.minor}"
        vendor = "cuda"
    known = _ARCH_TABLE.get(arch)
    caps = known[2] if known else _capabilities_from_version(vendor, props.major)
    return DeviceInfo(
        vendor=vendor,
        arch=arch,
        name=props.name,
        multiprocessors=props.multi_processor_count,
        capabilities=caps,
    )


def _capabilities_from_version(vendor: Vendor, major: int) -> frozenset[str]:
    """Conservative flags for an arch missing from the table."""
    if vendor == "cuda" and major >= 10:
        return frozenset({"bf16", "fp8", "scaled_mma", "tma"})
    if vendor == "cuda" and major >= 8:
        return frozenset({"bf16"})
    return frozenset()


def _after_fork() -> None:
    # A thread of the parent may have held the lock at fork; the child has no such thread.
    global _detect_lock
    _detect_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


@contextlib.contextmanager
def use_device(device: DeviceInfo | str) -> Iterator[DeviceInfo]:
    """Describe problems in this thread / task as being on ``device`` (an arch name or a
    DeviceInfo): ``explain`` and ``describe_problem`` without tensors, and ``list_backends``,
    answer "what would be chosen there?". Calls on real tensors still route by the chip
    under the tensors."""
    info = DeviceInfo.for_arch(device) if isinstance(device, str) else device
    if not isinstance(info, DeviceInfo):
        raise InvalidArgumentError("device", device, "an arch name or a DeviceInfo")
    with pushed(_described, [info]):  # out-of-order exits remove only their own frame
        yield info


@contextlib.contextmanager
def emulated(chip: DeviceInfo | str, device: torch.device | str = "cpu") -> Iterator[DeviceInfo]:
    """For tests: calls on tensors on ``device`` route, inside the block and in every
    thread, as if that device were ``chip``, e.g. Triton's CPU interpreter down gfx950's
    ``dot_scaled`` path, or an H200 through Triton's emulation of sm_100's. Unlike
    ``use_device``, which only describes, this changes what real calls run."""
    info = DeviceInfo.for_arch(chip) if isinstance(chip, str) else chip
    if not isinstance(info, DeviceInfo):
        raise InvalidArgumentError("chip", chip, "an arch name or a DeviceInfo")
    target = torch.device(device)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    frame = [info]
    with _detect_lock:
        _emulations[target] = (*_emulations.get(target, ()), frame)
    _changed()
    try:
        yield info
    finally:
        # Only this scope's frame goes: a scope exited out of order leaves the others in
        # force (the innermost one still in force decides), as ``use_device`` does.
        with _detect_lock:
            rest = tuple(f for f in _emulations[target] if f is not frame)
            if rest:
                _emulations[target] = rest
            else:
                del _emulations[target]
        _changed()


def _changed() -> None:
    for callback in _listeners:
        callback()
