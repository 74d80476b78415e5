"""DeviceInfo: what the chip under a call is and can do.

Detected once per torch device, and overridable (``use_device``) so that dispatch
decisions for another chip ("what would run on gfx950?") can be asked and tested on any
machine. An override changes what backends are *told* about the chip; tensors stay
where they are, so a backend that needs the real hardware checks ``Problem.placement``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import platform
import threading
from collections.abc import Iterator
from typing import Literal

import torch

from grouped_gemm.errors import InvalidArgumentError

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
        """A described device of a known arch, for ``explain`` and for tests."""
        key = arch.lower()
        if key not in _ARCH_TABLE:
            raise InvalidArgumentError("arch", arch, f"known archs are {', '.join(sorted(_ARCH_TABLE))}")
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


def torch_device(choice: str) -> torch.device:
    """A command line's ``--device`` (``auto``, ``cpu``, ``cuda``) as a torch device."""
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError("device", choice, "'cpu' on this machine: torch sees no GPU")
    return torch.device(choice)


def known_archs() -> tuple[str, ...]:
    """The arch names ``DeviceInfo.for_arch`` accepts."""
    return tuple(sorted(_ARCH_TABLE))


_detected: dict[torch.device, DeviceInfo] = {}
_detect_lock = threading.Lock()
_override: contextvars.ContextVar[DeviceInfo | None] = contextvars.ContextVar(
    "grouped_gemm_device_override", default=None
)


def device_info(device: torch.device) -> DeviceInfo:
    """The DeviceInfo for a torch device: the active override, else the detected chip."""
    override = _override.get()
    if override is not None:
        return override
    info = _detected.get(device)
    if info is None:
        with _detect_lock:
            info = _detected.get(device) or _detect(device)
            _detected[device] = info
    return info


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
    """Make dispatch in this thread / task treat the chip as ``device`` (an arch name or
    a DeviceInfo). Tensors are not moved: this answers "what would be chosen there?" and
    lets arch-dependent code paths run under the Triton interpreter on CPU."""
    info = DeviceInfo.for_arch(device) if isinstance(device, str) else device
    if not isinstance(info, DeviceInfo):
        raise InvalidArgumentError("device", device, "an arch name or a DeviceInfo")
    token = _override.set(info)
    try:
        yield info
    finally:
        _override.reset(token)
