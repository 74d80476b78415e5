"""Compile the ``hip_mxfp8`` kernels on first use, once per process, into a per-user cache.

The extension (``csrc/``) is built with ``torch.utils.cpp_extension.load`` (ninja; nvcc on
CUDA, hipcc after PyTorch's hipify on ROCm) into
``$GROUPED_GEMM_CACHE_DIR/<key>`` (default ``~/.cache/grouped_gemm``), where the key holds
the arch, the torch version and a hash of the sources, so a changed source, torch or chip
gets its own build and an unchanged one is loaded without compiling. A file lock
(``fcntl.flock``) on the build directory makes concurrent processes build it once. Every
outcome, including "this torch cannot compile CUDA code", is a ``BuildResult`` with a log
file: failures become eligibility reasons, never exceptions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import logging
import os
import re
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

CACHE_ENV = "GROUPED_GEMM_CACHE_DIR"
CSRC = Path(__file__).parent / "csrc"
#: Every file the build reads: a change to any of them changes the key.
SOURCES = ("binding.cu", "mxfp8_grouped.cuh")
LOG_NAME = "build.log"
#: A child of the library's logger: ``GROUPED_GEMM_LOG_LEVEL`` and the application's handlers apply.
LOGGER = logging.getLogger("grouped_gemm.backends.hip_mxfp8")


@dataclasses.dataclass(frozen=True)
class BuildResult:
    """A finished build attempt: the loaded module, or why there is none; ``log`` is the
    compiler output (or the reason it was not run)."""

    arch: str
    log: Path
    module: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.module is not None

    def __str__(self) -> str:
        if self.ok:
            return f"built for {self.arch} ({self.log.parent})"
        return f"not built for {self.arch}: {self.error} (log: {self.log})"


def cache_root() -> Path:
    """``$GROUPED_GEMM_CACHE_DIR``, else ``~/.cache/grouped_gemm``; OSError when the home
    directory it names cannot be found (``~user`` of no such user, no home at all), which
    pathlib raises as a RuntimeError that callers handling OSError would miss."""
    configured = os.environ.get(CACHE_ENV, "").strip()
    try:
        return Path(configured).expanduser() if configured else Path.home() / ".cache" / "grouped_gemm"
    except RuntimeError as exc:
        raise OSError(f"{CACHE_ENV}={configured!r}: {exc}" if configured else str(exc)) from None


def source_hash() -> str:
    """The first 16 hex digits of a SHA-256 over every source's name and bytes."""
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode())
        digest.update((CSRC / name).read_bytes())
    return digest.hexdigest()[:16]


def build_key(arch: str) -> str:
    """Directory name of one build: ``hip_mxfp8-<arch>-torch<version>-<source hash>``."""
    version = re.sub(r"[^A-Za-z0-9.]+", "_", torch.__version__)
    return f"hip_mxfp8-{arch}-torch{version}-{source_hash()}"


def build_dir(arch: str) -> Path:
    return cache_root() / build_key(arch)


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``directory/.lock`` (created with the directory); another
    process asking for it waits until this one is done."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def blocker(vendor: str) -> str | None:
    """Why this process cannot build for a ``vendor`` GPU at all (None: it can try)."""
    from torch.utils import cpp_extension

    if vendor == "cuda":
        if torch.version.cuda is None:
            return f"torch {torch.__version__} is not a CUDA build (torch.version.cuda is None)"
        if cpp_extension.CUDA_HOME is None:
            return "no CUDA toolkit found (nvcc); set CUDA_HOME"
    elif vendor == "rocm":
        if torch.version.hip is None:
            return f"torch {torch.__version__} is not a ROCm build (torch.version.hip is None)"
        if cpp_extension.ROCM_HOME is None:
            return "no ROCm toolkit found (hipcc); set ROCM_HOME"
    else:
        return f"no GPU kernels for vendor {vendor}"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    if not torch.cuda.is_available():
        return "torch sees no GPU"
    return None


def arch_flags(arch: str) -> list[str]:
    """Compiler flags for one target: ``sm_89`` -> its SASS; ``sm_90`` -> sm_90a's (the
    prescaled path's wgmma exists only there); ``gfx950`` -> ``--offload-arch``."""
    if arch.startswith("sm_"):
        cc = arch[3:] + ("a" if arch == "sm_90" else "")
        return [f"-gencode=arch=compute_{cc},code=sm_{cc}"]
    return [f"--offload-arch={arch}"]


def compile_extension(arch: str, directory: Path, portable: bool = False, defines: tuple[str, ...] = ()) -> Any:
    """Build (or load the up-to-date build of) the extension in ``directory``. ``portable``
    compiles the ROCm inner product (software E4M3 decode, fp32 FMAs) for a CUDA GPU, so
    the GPU tests can check that path where no ROCm compiler is; ``defines`` (``NAME=VALUE``)
    set the header's A/B knobs, for the GPU tests of a path not yet on by default.

    The sources are copied into ``directory/src`` first: on ROCm, PyTorch's hipify writes
    converted files next to the sources, which an installed package may not allow."""
    from torch.utils import cpp_extension

    sources = directory / "src"
    sources.mkdir(exist_ok=True)
    for name in SOURCES:
        target = sources / name
        content = (CSRC / name).read_bytes()
        if not target.exists() or target.read_bytes() != content:
            target.write_bytes(content)
    flags = (["GG_MXFP8_PORTABLE"] if portable else []) + list(defines)
    variant = "_" + hashlib.sha256("+".join(defines).encode()).hexdigest()[:8] if defines else ""
    name = f"gg_hip_mxfp8_{'portable_' if portable else ''}{source_hash()}{variant}"
    if not (directory / f"{name}.so").exists():
        # A minute of nvcc in the middle of a first call looks like a hang without this.
        LOGGER.warning(
            "compiling hip_mxfp8 for %s into %s: about a minute, once per machine, torch and source version "
            "(`grouped-gemm build hip_mxfp8` does it ahead of time)",
            arch,
            directory,
        )
    return cpp_extension.load(
        name=name,
        sources=[str(sources / "binding.cu")],
        extra_include_paths=[str(sources)],
        extra_cuda_cflags=["-O3", "-std=c++17", *arch_flags(arch), *(f"-D{flag}" for flag in flags)],
        build_directory=str(directory),
        verbose=False,
    )


def attempt(arch: str, vendor: str, compile_fn: Callable[[str, Path], Any] = compile_extension) -> BuildResult:
    """One build attempt under the directory lock; the outcome and its log, never an exception."""
    reason = blocker(vendor)
    directory = None
    try:
        directory = build_dir(arch)
        with locked(directory):
            log = directory / LOG_NAME
            if reason is not None:
                log.write_text(f"not built: {reason}\n")
                return BuildResult(arch, log, error=reason)
            try:
                module = compile_fn(arch, directory)
            except Exception as exc:  # noqa: BLE001 - a failed build is reported, not raised
                log.write_text("".join(traceback.format_exception(exc)))
                first = str(exc).strip().splitlines()
                return BuildResult(arch, log, error=f"build failed: {first[0] if first else type(exc).__name__}")
            log.write_text(f"built {module.__file__} for {arch} with torch {torch.__version__}\n")
            return BuildResult(arch, log, module=module)
    except OSError as exc:
        log = directory / LOG_NAME if directory is not None else Path(os.devnull)  # no directory: no log
        return BuildResult(arch, log, error=f"cache directory unusable ({exc}); set {CACHE_ENV}")


_results: dict[str, BuildResult] = {}
_lock = threading.Lock()


def result(arch: str) -> BuildResult | None:
    """This process's build outcome for ``arch``, if it tried."""
    return _results.get(arch)


def all_results() -> list[BuildResult]:
    """Every build outcome of this process, by arch."""
    return [_results[arch] for arch in sorted(_results)]


def ensure(arch: str, vendor: str) -> BuildResult:
    """The build for ``arch``: attempted once per process (threads wait for the first)."""
    with _lock:
        found = _results.get(arch)
        if found is None:
            found = _results[arch] = attempt(arch, vendor)
        return found


def forget() -> None:
    """Drop this process's outcomes (tests; a new toolkit on PATH)."""
    with _lock:
        _results.clear()
