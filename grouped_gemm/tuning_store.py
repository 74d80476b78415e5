"""Autotuning records and their JSON files: one file per device and software versions.

Files live in ``$GROUPED_GEMM_CACHE_DIR/autotune/`` (default ``~/.cache/grouped_gemm``),
named after the device and the torch / Triton versions, with a hash of every version
that can change a timing (torch, Triton, grouped_gemm, each registered backend) so an
upgrade starts a new file instead of trusting old numbers. Writers hold an advisory
lock, merge their entries into what is on disk, and replace the file atomically (a
temporary file, then ``os.replace``): concurrent processes never leave a torn file and
never drop each other's entries. Readers take no lock. A file that does not parse, has
another schema or other versions is ignored with an ``AutotuneCacheWarning``, never an
error; an unwritable directory keeps the choices in memory, with one warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

try:  # POSIX advisory locks; elsewhere writes stay atomic but concurrent merges may race
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

ENV_CACHE_DIR = "GROUPED_GEMM_CACHE_DIR"
SUBDIR = "autotune"
#: Bumped whenever the layout of a file changes; other schemas are ignored.
SCHEMA = 1

#: A backend kernel config as the tuner stores it: a small JSON object.
Config = Mapping[str, Any]


class AutotuneCacheWarning(UserWarning):
    """A persisted autotuning file was ignored (corrupt, stale) or could not be written."""


@dataclasses.dataclass(frozen=True)
class Timing:
    """One measured contender: a backend, optionally with one of its kernel configs.

    ``ms`` is the median of the timed calls, None when the contender was excluded
    (``note`` says why); a pruned contender keeps its probe time and says so in ``note``.
    """

    backend: str
    config: Config | None
    ms: float | None
    calls: int
    note: str = ""

    @property
    def label(self) -> str:
        """``backend`` or ``backend[key=value,...]``."""
        if self.config is None:
            return self.backend
        return f"{self.backend}[{','.join(f'{k}={v}' for k, v in self.config.items())}]"

    @property
    def usable(self) -> bool:
        """Measured and neither excluded nor pruned."""
        return self.ms is not None and not self.note


@dataclasses.dataclass(frozen=True)
class CloseCall:
    """Contenders the rotating rounds could not tell apart, re-timed side by side.

    ``labels`` (the fastest first) were within ``margin`` of the fastest by their round
    medians (``rounds_ms``); they were then timed alternating in short blocks, so that
    drift hits them alike. Their times in ``Tuning.timings`` come from that: the first
    one's round median, the others' that times their block-by-block ratio to it.
    ``calls`` is what that took, untimed calls included. ``ties``: the declared-rank-first
    of them and those that did not beat it consistently (``autotune.CONSISTENT_WINS``),
    which rank as a tie, so declared priority picks among them; empty when none.
    """

    labels: tuple[str, ...]
    rounds_ms: tuple[float, ...]
    margin: float
    calls: int
    ties: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for ``explain`` and ``grouped-gemm tune``."""
        rounds = " / ".join(f"{label} {ms:.4g}" for label, ms in zip(self.labels, self.rounds_ms, strict=True))
        tie = f"; not told apart consistently, so a tie: {' / '.join(self.ties)}" if self.ties else ""
        return (
            f"close call: {rounds} ms in the rounds (within {100 * self.margin:.0f} %), "
            f"re-timed interleaved: +{self.calls} calls{tie}"
        )


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The outcome of tuning one problem signature.

    ``choice`` / ``config`` won; ``priority_choice`` is what declared priority would
    have picked; ``timings`` lists every contender in declared-priority order;
    ``cost_ms`` is the wall time the measurement took; ``m`` the row count it ran with;
    ``close_call`` says which contenders needed interleaved timing to be told apart.
    ``origin`` (``measured`` or ``loaded``) is not persisted.
    """

    key: str
    problem: str
    m: int
    choice: str
    config: Config | None
    priority_choice: str
    timings: tuple[Timing, ...]
    cost_ms: float
    measured_at: str
    close_call: CloseCall | None = None
    origin: str = "measured"

    def backends(self) -> frozenset[str]:
        """Every backend this tuning measured or excluded."""
        return frozenset(t.backend for t in self.timings)

    def fastest_ms(self, backend: str) -> float | None:
        """A backend's fastest time over its configs, probes of pruned ones included
        (None if it was excluded): what the ranking after the choice follows."""
        times = [t.ms for t in self.timings if t.backend == backend and t.ms is not None]
        return min(times) if times else None

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        del out["key"], out["origin"]
        return out

    @classmethod
    def from_json(cls, key: str, data: Mapping[str, Any]) -> Tuning:
        """Parse one entry; KeyError / TypeError / ValueError on a malformed one."""
        timings = tuple(
            Timing(
                backend=str(t["backend"]),
                config=_config(t.get("config")),
                ms=None if t["ms"] is None else _duration(t["ms"]),
                calls=int(t["calls"]),
                note=str(t.get("note", "")),
            )
            for t in data["timings"]
        )
        return cls(
            key=key,
            problem=str(data["problem"]),
            m=int(data["m"]),
            choice=str(data["choice"]),
            config=_config(data.get("config")),
            priority_choice=str(data["priority_choice"]),
            timings=timings,
            cost_ms=_duration(data["cost_ms"]),
            measured_at=str(data["measured_at"]),
            close_call=_close_call(data.get("close_call")),
            origin="loaded",
        )


def _duration(value: Any) -> float:
    """A stored time in ms: finite and not negative (a NaN ``json.dump`` writes, or a hand
    edit, would otherwise win every comparison or none)."""
    ms = float(value)
    if not math.isfinite(ms) or ms < 0:
        raise ValueError(f"a time of {value!r} ms")
    return ms


def _close_call(value: Any) -> CloseCall | None:
    if value is None:
        return None
    labels = tuple(str(label) for label in value["labels"])
    rounds_ms = tuple(float(ms) for ms in value["rounds_ms"])
    if len(labels) != len(rounds_ms):
        raise ValueError("a close call needs one rounds time per label")
    ties = tuple(str(label) for label in value.get("ties", ()))
    return CloseCall(labels, rounds_ms, float(value["margin"]), int(value["calls"]), ties)


def _config(value: Any) -> Config | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"a config must be a JSON object, got {type(value).__name__}")
    return value


def cache_root() -> Path:
    """``$GROUPED_GEMM_CACHE_DIR/autotune``, else ``~/.cache/grouped_gemm/autotune``."""
    base = os.environ.get(ENV_CACHE_DIR, "").strip()
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "grouped_gemm"
    return root / SUBDIR


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower() or "unknown"


def file_for(device_name: str, arch: str, versions: Mapping[str, Any]) -> Path:
    """The file of one device and set of versions (see the module docstring)."""
    digest = hashlib.sha256(json.dumps(versions, sort_keys=True).encode()).hexdigest()[:12]
    name = f"{_slug(device_name)}_{arch}_torch{_slug(str(versions.get('torch')))}"
    name += f"_triton{_slug(str(versions.get('triton')))}_{digest}.json"
    return cache_root() / name


def load(path: Path, header: Mapping[str, Any]) -> dict[str, Tuning]:
    """The entries of ``path`` if its header matches ``header``; {} (and a warning for a
    corrupt or stale file) otherwise. A missing file is simply empty."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except UnicodeDecodeError as exc:  # a ValueError, not an OSError
        _warn(f"ignoring corrupt autotune cache {path}: {exc}")
        return {}
    except OSError as exc:
        _warn(f"cannot read autotune cache {path}: {exc}; measuring again")
        return {}
    return _parse(path, text, header, warn=True)


def _parse(path: Path, text: str, header: Mapping[str, Any], warn: bool) -> dict[str, Tuning]:
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: brackets nested too deep
        if warn:
            _warn(f"ignoring corrupt autotune cache {path}: {exc}")
        return {}
    return _entries(path, data, header, warn)


def _entries(path: Path, data: Any, header: Mapping[str, Any], warn: bool) -> dict[str, Tuning]:
    """The entries of a parsed file whose schema and header match; {} otherwise."""
    try:
        if not isinstance(data, dict):
            raise TypeError("the top level is not a JSON object")
        if data.get("schema") != SCHEMA or any(data.get(k) != v for k, v in header.items()):
            if warn:
                _warn(f"ignoring stale autotune cache {path}: written for another schema, device or versions")
            return {}
        return {str(k): Tuning.from_json(str(k), v) for k, v in data["entries"].items()}
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:  # Overflow: int(Infinity)
        if warn:
            _warn(f"ignoring corrupt autotune cache {path}: {type(exc).__name__}: {exc}")
        return {}


def save(path: Path, header: Mapping[str, Any], entries: Mapping[str, Tuning]) -> bool:
    """Merge ``entries`` into ``path`` (ours win on equal keys), atomically, under the
    file's lock. False (after a warning) when the directory cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            try:
                current = _parse(path, path.read_text(encoding="utf-8"), header, warn=False)
            except (FileNotFoundError, UnicodeDecodeError):  # missing or not text: rewritten whole
                current = {}
            merged = {**current, **entries}
            document = {
                "schema": SCHEMA,
                **header,
                "entries": {k: merged[k].to_json() for k in sorted(merged)},
            }
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(document, f, indent=1)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
    except OSError as exc:
        _warn(f"cannot write autotune cache {path}: {exc}; choices are kept for this process only")
        return False
    return True


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``<path>.lock`` (a no-op without fcntl)."""
    if fcntl is None:  # pragma: no cover - Windows
        yield
        return
    with open(str(path) + ".lock", "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def stored_files() -> list[Path]:
    """Every autotune file under the cache root, by name."""
    root = cache_root()
    return sorted(root.glob("*.json")) if root.is_dir() else []


def read_any(path: Path) -> tuple[dict[str, Any], dict[str, Tuning]]:
    """(header, entries) of a file whatever versions it was written for, for
    ``grouped-gemm tune --show``; ({}, {}) with a warning if it does not parse."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        _warn(f"ignoring unreadable autotune cache {path}: {type(exc).__name__}: {exc}")
        return {}, {}
    header = {k: v for k, v in data.items() if k not in ("entries", "schema")} if isinstance(data, dict) else {}
    if not isinstance(header.get("versions", {}), dict):
        _warn(f"ignoring corrupt autotune cache {path}: its versions are not a JSON object")
        return {}, {}
    return header, _entries(path, data, header, warn=True)


def _warn(message: str) -> None:
    warnings.warn(message, AutotuneCacheWarning, stacklevel=4)
