"""Autotuning: time a problem's eligible backends on its own operands and keep the fastest.

Off by default; on with ``configure(autotune=True)``, ``GROUPED_GEMM_AUTOTUNE=1`` or a
``use_backends(autotune=True)`` scope. It replaces only the declared-priority ranking:
an order the user set (per call, scope, ``configure`` or environment) still decides.

On the first call of a problem signature the dispatcher hands the call's operands to
``Tuner.measure``: every eligible backend (and every kernel config a backend offers
through the optional ``configs(problem)`` / ``run_config(problem, inputs, config)``
hook) runs once into a scratch buffer -- never into the caller's ``out``; with
``accumulate`` each starts from a copy of it -- and the results are compared with each
other. A contender that raises, or disagrees with the majority beyond the output
dtype's tolerance, is excluded with the reason. The others are probed (a contender
more than ``PRUNE_FACTOR`` times slower than the fastest probe stops there), then
timed in rounds, each after a warm-up, taking turns (CUDA events on a GPU, the
monotonic ``perf_counter`` on the CPU); the median wins. A few blocks each cannot tell
apart contenders within a few percent of each other (clocks drift between blocks), so
when others are within ``CLOSE_MARGIN`` of the fastest, the closest (``CLOSE_MAX`` at
most, each backend's best config before a second config of any) are timed again
alternating in short blocks (``interleave``) and their block by block ratios decide
(``paired_ms``): a close call. Times within ``TIE_MARGIN`` of the fastest count as a
tie, which declared priority breaks, so equal timings give the same choice every time;
but a close call's fastest that beat the declared-first one in most block pairs
(``CONSISTENT_WINS``) and leads by more than half the margin wins (``choose``).
The choice lands in the decision cache (later calls pay nothing) and in a JSON file
per device (``tuning_store``), which later processes load instead of measuring.

Nothing is measured under CUDA-graph capture, under ``torch.compile`` tracing, or for a
described device (``use_device``): a stored choice is used if there is one, else
declared priority.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.metadata
import math
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from grouped_gemm import tuning_store
from grouped_gemm.backend_hooks import prepared_reasons
from grouped_gemm.clock import Clock
from grouped_gemm.config import LOGGER
from grouped_gemm.decision import Candidate, Decision
from grouped_gemm.device import DeviceInfo
from grouped_gemm.errors import UnknownBackendError
from grouped_gemm.inputs import GroupedInputs
from grouped_gemm.plugins import PLUGIN_ERRORS
from grouped_gemm.problem import Problem, m_bucket
from grouped_gemm.registry import Registry, registry
from grouped_gemm.tuning_store import CloseCall, Config, Timing, Tuning

#: Times within this fraction of the fastest are a tie, broken by declared priority.
TIE_MARGIN = 0.02
#: A contender whose probe is this many times the fastest probe is not timed further.
PRUNE_FACTOR = 2.0
#: After the rounds, contenders this close to the fastest are timed again, interleaved. On
#: the H200 (2026-12-03) the rounds' ratio of torch_grouped_mm to multistream differed
#: from the same pair timed separately by up to 9 points (8.9 % against 0.8 %). On
#: mixtral_down bf16 wgrad (H200 and H100, 2026-12-04 to 06) the tuner's rounds put
#: multistream 0.1-4.1 % behind it in four runs, and one separate timing's rounds 10.0 %,
#: while interleaved blocks had multistream 1.9-2.4 % ahead in all four.
CLOSE_MARGIN = 0.15
#: At most this many close contenders (the fastest first) are timed interleaved; others
#: as close keep their round medians and are pruned.
CLOSE_MAX = 3
#: A close contender displaces the declared-rank-first one only if it is faster in at least
#: this share of their A B / B A block pairs (drift cancels within a pair). On the H200
#: (2026-12-04) one backend's time on dsv3_gateup_ep8 bf16 wgrad swung 1.56-1.79 ms
#: between rounds, and a 2.6 % lead in a close call picked a backend the separate timing
#: put 12 % behind: a lead that flips from pair to pair is not one.
CONSISTENT_WINS = 0.75
#: More configs than this from one backend are a plugin bug (tuning cost explodes).
MAX_CONFIGS = 32
#: Elements compared per chunk, so agreement checks need no float64 copy of a result.
_CHUNK = 1 << 24
_SIGNIFICAND_BITS = {"bfloat16": 8, "float16": 11, "float32": 24}
#: fp32 results legitimately differ by accumulation order (and TF32, if the user allows it).
_AGREEMENT_CAP_DB = 50.0


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per contender: a probe (the fastest of ``probe_calls``), then ``rounds`` blocks, each a warm-up
    (``warmup_ms`` before the first block, a quarter of it before the others, at least
    ``min_warmup`` calls) and ``rep_ms / rounds`` of timed calls (``min_reps`` to
    ``max_reps`` timed calls in all)."""

    probe_calls: int = 3
    warmup_ms: float = 10.0
    min_warmup: int = 2
    rep_ms: float = 30.0
    min_reps: int = 6
    max_reps: int = 90
    rounds: int = 3

    def block(self, per_call_ms: float, first: bool) -> tuple[int, int]:
        """(warm-up calls, timed calls) of one block for a call of ``per_call_ms``."""
        per_call = max(per_call_ms, 1e-4)
        warmup = max(self.min_warmup if first else 1, int((self.warmup_ms if first else self.warmup_ms / 4) / per_call))
        reps = int(self.rep_ms / self.rounds / per_call)
        return warmup, min(max(1, self.max_reps // self.rounds), max(-(-self.min_reps // self.rounds), reps))


PLAN = Plan()


@dataclasses.dataclass(frozen=True)
class ClosePlan:
    """How close contenders are timed side by side: ``blocks`` times, each contender in
    turn runs one untimed call (it absorbs whatever the previous contender left behind:
    a launch queue, a cold cache) and then ``block`` timed calls. A block lasts about
    ``block_ms`` (``min_block`` to ``max_block`` calls) so drift hits neighbours alike;
    there are enough blocks for about ``rep_ms`` of timed calls per contender
    (``min_blocks`` to ``max_blocks``, rounded up to even)."""

    rep_ms: float = 40.0
    block_ms: float = 1.0
    min_block: int = 2
    max_block: int = 8
    min_blocks: int = 8
    max_blocks: int = 40

    def blocks(self, per_call_ms: float) -> tuple[int, int]:
        """(blocks, timed calls per block) for contenders of about ``per_call_ms``."""
        per_call = max(per_call_ms, 1e-4)
        block = min(self.max_block, max(self.min_block, round(self.block_ms / per_call)))
        blocks = min(self.max_blocks, max(self.min_blocks, math.ceil(self.rep_ms / (block * per_call))))
        return blocks + blocks % 2, block


CLOSE_PLAN = ClosePlan()


def close_to_fastest(
    times: Mapping[str, float], margin: float | None = None, backends: Mapping[str, str] | None = None
) -> list[str]:
    """The labels within ``margin`` (default ``CLOSE_MARGIN``) of the fastest, fastest
    first, at most ``CLOSE_MAX``; [] when there is no other.

    ``backends`` (label -> backend; default: each label its own) puts each backend's
    fastest label in before a second config of any: on the H200 (2026-12-05) three
    ``triton_grouped`` tiles within 0.3 % of each other filled a close call, and
    ``torch_grouped_mm``, 5 % behind them in the rounds and the fastest measured
    separately, was pruned (dsv3_gateup_ep8 bf16 fwd, an 11 % miss; mixtral_gateup
    skewed dgrad lost ``multistream`` the same way)."""
    margin = CLOSE_MARGIN if margin is None else margin
    ranked = sorted(times, key=times.get)
    if not ranked:
        return []
    within = [label for label in ranked if times[label] <= times[ranked[0]] * (1.0 + margin)]
    backend_of = backends.get if backends is not None else (lambda label: label)
    seen: set[str | None] = set()
    leaders, seconds = [], []
    for label in within:
        backend = backend_of(label)
        (seconds if backend in seen else leaders).append(label)
        seen.add(backend)
    close = sorted((leaders + seconds)[:CLOSE_MAX], key=times.get)
    return close if len(close) > 1 else []


def interleave(
    calls: Sequence[Callable[[int], object]], per_call_ms: float, clock: Clock, plan: ClosePlan
) -> tuple[list[list[list[float]]], int]:
    """Time ``calls`` alternating at fine grain, as ``plan`` says, in the order A B, B A,
    A B, ... (a linear drift cancels out of each A B, B A); ``calls[j](i)`` runs
    contender ``j``'s ``i``-th call. Per contender, the ms of its timed calls block by
    block; and the number of calls made, untimed ones included. Exceptions propagate.

    Each block starts after a device sync, so no block pays for work its predecessor
    left queued: on the H200 (2026-12-04), without it, ``torch_grouped_mm`` right after
    ``multistream`` (side streams, per-group allocations) timed 1.02 ms in blocks against
    0.83 ms in rounds, and the close call went the wrong way."""
    blocks, block = plan.blocks(per_call_ms)
    stamps: list[list[list[tuple[object, object]]]] = [[] for _ in calls]
    made = [0] * len(calls)
    forward = list(range(len(calls)))
    for b in range(blocks):
        for j in forward if b % 2 == 0 else forward[::-1]:
            clock.sync()
            calls[j](made[j])
            made[j] += 1
            pairs = []
            for _ in range(block):
                start = clock.stamp()
                calls[j](made[j])
                pairs.append((start, clock.stamp()))
                made[j] += 1
            stamps[j].append(pairs)
    clock.sync()
    return [[[clock.ms(s, e) for s, e in pairs] for pairs in per_block] for per_block in stamps], sum(made)


def paired_ms(blocks: Sequence[Sequence[Sequence[float]]], base_ms: float | None = None) -> list[float]:
    """Each contender's time from ``interleave``'s blocks: the first one's, and for each
    other the first one's times the median of its ratios to the first one block by block
    (medians of neighbouring blocks), which a drift shared by neighbours cancels out of.

    The first one's time is ``base_ms`` where given (its median in the rotating rounds, so
    that the paired times compare with contenders timed in rounds only: short blocks,
    each after a device sync, time longer; on an H100, 2026-12-06, 2.84 ms in blocks
    against 2.30 ms in rounds, which let a contender 17 % behind in the rounds win), else
    its median in the blocks."""
    first = blocks[0]
    base = _median([ms for block in first for ms in block]) if base_ms is None else base_ms
    return [base] + [
        base * _median([_median(mine) / _median(ref) for mine, ref in zip(other, first, strict=True)])
        for other in blocks[1:]
    ]


def agreement_floor_db(out_dtype: str) -> float:
    """The SQNR two correct results of one problem reach against each other.

    Each is the exact result rounded to ``p`` significand bits (at most 2^-p relative
    error, 20 p log10(2) dB), so two of them differ by up to twice that: 6 dB less.
    Capped at 50 dB, since fp32 results differ by accumulation order. bf16: 42.2 dB.
    """
    bits = _SIGNIFICAND_BITS.get(out_dtype, 8)
    return min(_AGREEMENT_CAP_DB, 20.0 * bits * math.log10(2.0) - 6.0)


def agreement_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    """SQNR of ``other`` against ``reference`` in dB, over elements finite in both (they
    must be non-finite at the same places, else -inf); inf when equal."""
    if reference.shape != other.shape:
        return -math.inf
    a, b = reference.reshape(-1), other.reshape(-1)
    signal = noise = 0.0
    for start in range(0, a.numel(), _CHUNK):
        x = a[start : start + _CHUNK].to(torch.float64)
        y = b[start : start + _CHUNK].to(torch.float64)
        fx, fy = torch.isfinite(x), torch.isfinite(y)
        if not torch.equal(fx, fy):
            return -math.inf
        x, y = torch.where(fx, x, 0.0), torch.where(fy, y, 0.0)
        signal += float(torch.sum(x * x))
        noise += float(torch.sum((x - y) ** 2))
    if noise == 0.0:
        return math.inf
    return -math.inf if signal == 0.0 else 10.0 * math.log10(signal / noise)


def choose(
    timings: Sequence[Timing], rank: Mapping[str, int], margin: float | None = None, close: CloseCall | None = None
) -> Timing | None:
    """The winner among usable timings of backends in ``rank`` (name -> declared rank,
    lower first): the fastest, or among those within ``margin`` (default ``TIE_MARGIN``)
    of it the best-ranked backend (its first listed config). After a ``close`` call its
    ``ties`` are one more tie (when one of them is within ``margin`` of the fastest, all
    of them compete on rank too), and its fastest contender, if not among ``ties`` (it
    beat the declared-first one in most block pairs), wins when it leads the best-ranked
    one by more than half the margin. On an H100 (2026-12-06) ``multistream`` led
    ``torch_grouped_mm`` that way by 1.9 % on mixtral_gateup bf16 wgrad, was tied away,
    and was 4.9 % faster timed separately; consistent leads of 0.1-0.9 % were common
    (four block pairs are little evidence) and are still ties, so equal speeds keep
    going to declared priority. None if none is usable."""
    margin = TIE_MARGIN if margin is None else margin
    usable = [(i, t) for i, t in enumerate(timings) if t.usable and t.backend in rank]
    if not usable:
        return None
    fastest = min(usable, key=lambda it: it[1].ms)[1]
    ties = close.ties if close else ()
    tied = [(i, t) for i, t in usable if t.ms <= fastest.ms * (1.0 + margin)]
    if any(t.label in ties for _, t in tied):
        tied = [(i, t) for i, t in usable if t.ms <= fastest.ms * (1.0 + margin) or t.label in ties]
    by_rank = min(tied, key=lambda it: (rank[it[1].backend], it[0]))[1]
    consistent = close is not None and fastest.label in close.labels and fastest.label not in ties
    if consistent and by_rank.ms > fastest.ms * (1.0 + margin / 2):
        return fastest
    return by_rank


def pair_wins(mine: Sequence[Sequence[float]], ref: Sequence[Sequence[float]]) -> float:
    """The share of ``interleave``'s A B / B A block pairs in which ``mine`` was faster than
    ``ref``: per pair the geometric mean of the two block ratios (block medians), in
    which a drift shared by the pair cancels. 0.0 without a full pair."""
    ratios = [_median(list(a)) / _median(list(b)) for a, b in zip(mine, ref, strict=True)]
    pairs = [ratios[i] * ratios[i + 1] for i in range(0, len(ratios) - 1, 2)]
    return sum(p < 1.0 for p in pairs) / len(pairs) if pairs else 0.0


def tuning_key(problem: Problem) -> str:
    """A problem's signature as a string, without the device (it names the file) and
    without capture (a choice measured outside a graph serves the captured call).

    With host splits it holds the largest group (``max_rows``, a power of two) beside M's
    bucket, so a skewed split is tuned apart from a balanced one of the same shape (on
    the H200 their best backends differ: docs/performance.md, issue 16). Device splits
    cannot say (reading them is a sync): their key has ``max_rows=None``."""
    p = problem
    return (
        f"{p.op}|{p.recipe}|G={p.groups}|M<={m_bucket(p.m)}|N={p.n}|K={p.k}|{p.a_format}x{p.b_format}->{p.out_dtype}"
        f"|{p.placement}|scale={p.scale_rule}|grad={p.grad_format}|host_splits={int(p.host_splits)}"
        f"|weight_list={int(p.weight_list)}|accumulate={int(p.accumulate)}|contiguous={int(p.contiguous)}"
        f"|m_align={p.m_align}|max_rows={p.max_rows}"
    )


def can_measure(problem: Problem) -> bool:
    """Whether timing is allowed now: a real device, no graph capture, no compile tracing."""
    return problem.device.detected and not problem.capturing and not torch.compiler.is_compiling()


def _triton_version() -> str:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def versions(reg: Registry) -> dict[str, Any]:
    """Everything whose change invalidates a timing: torch, Triton, each backend."""
    return {
        "torch": torch.__version__,
        "triton": _triton_version(),
        "backends": {e.spec.name: e.spec.version for e in reg.entries()},
    }


@dataclasses.dataclass
class _Contender:
    """One backend (and config) being measured, with its own scratch output (``_scratch``)."""

    name: str
    backend: Any
    config: Config | None
    scratch: Any = None
    note: str = ""
    estimate_ms: float = math.inf
    times: list[float] = dataclasses.field(default_factory=list)
    paired_ms: float | None = None
    calls: int = 0

    @property
    def label(self) -> str:
        return Timing(self.name, self.config, None, 0).label

    def call(self, problem: Problem, inputs: GroupedInputs) -> Any:
        self.calls += 1
        fresh = GroupedInputs(inputs.a, inputs.b, inputs.m_splits, self.scratch)
        if self.config is None:
            return self.backend.run(problem, fresh)
        return self.backend.run_config(problem, fresh, self.config)

    def timing(self) -> Timing:
        if self.note:
            pruned = self.note.startswith("pruned")
            return Timing(self.name, self.config, self.estimate_ms if pruned else None, self.calls, self.note)
        ms = _median(self.times) if self.paired_ms is None else self.paired_ms
        return Timing(self.name, self.config, ms, len(self.times))


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def _scratch(problem: Problem, out: Any) -> Any:
    """A private output like the caller's: a copy when accumulating (same starting
    values for every contender), else uninitialized; None when the caller gave none."""
    if out is None:
        return None
    if isinstance(out, list):
        return [t.clone() if problem.accumulate else torch.empty_like(t) for t in out]
    return out.clone() if problem.accumulate else torch.empty_like(out)


def _as_tensor(result: Any) -> torch.Tensor:
    if isinstance(result, (list, tuple)):
        return torch.stack(list(result))
    if not isinstance(result, torch.Tensor):
        raise TypeError(f"run returned {type(result).__name__}, not a tensor")
    return result


def _same_config(stored: Config, offered: Config) -> bool:
    """Equal keys and values of equal types. ``==`` has ``2.0 == 2 == True``: a stored
    ``{"bm": 64.0}`` (a hand edit, a JSON tool) matched the offered ``{"bm": 64}`` and
    reached the backend, whose check of the int tile then failed every call."""
    return stored.keys() == offered.keys() and all(
        type(value) is type(offered[key]) and value == offered[key] for key, value in stored.items()
    )


def _configs(backend: Any, problem: Problem) -> list[Config]:
    """A backend's kernel configs for ``problem`` via the optional hook (none without it)."""
    configs_of = getattr(backend, "configs", None)
    if not callable(configs_of):
        return []
    configs = list(configs_of(problem))
    if configs and not callable(getattr(backend, "run_config", None)):
        raise TypeError("has configs() but no run_config(problem, inputs, config)")
    if len(configs) > MAX_CONFIGS:
        raise ValueError(f"offers {len(configs)} configs; at most {MAX_CONFIGS}")
    for config in configs:
        if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
            raise TypeError(f"config {config!r} is not a dict with string keys")
        if not all(isinstance(v, (str, int, float, bool)) or v is None for v in config.values()):
            raise TypeError(f"config {config!r} has values that are not JSON scalars")
    return configs


class Tuner:
    """Stored and measured choices of one process, and its counters."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._files: dict[tuple, tuple[Path, dict[str, Any]]] = {}
        self._tables: dict[Path, dict[str, Tuning]] = {}
        self._loaded_used: set[tuple[Path, str]] = set()
        self.tuned = 0
        self.close_calls = 0
        self.calls = 0
        self.cost_ms = 0.0

    # --- stored choices -----------------------------------------------------------

    def _file(self, device: DeviceInfo) -> tuple[Path, dict[str, Any]]:
        reg = registry()
        token = (device, reg.epoch, tuning_store.cache_root())
        found = self._files.get(token)
        if found is None:
            header = {"device": device.name, "arch": device.arch, "versions": versions(reg)}
            found = self._files[token] = (tuning_store.file_for(device.name, device.arch, header["versions"]), header)
        return found

    def file_for(self, device: DeviceInfo) -> Path:
        """The JSON file holding this device's choices for the software loaded now."""
        return self._file(device)[0]

    def _table(self, device: DeviceInfo) -> tuple[Path, dict[str, Any], dict[str, Tuning]]:
        path, header = self._file(device)
        with self._lock:
            table = self._tables.get(path)
            if table is None:
                table = self._tables[path] = tuning_store.load(path, header)
        return path, header, table

    def lookup(self, problem: Problem) -> Tuning | None:
        """The stored tuning of a problem's signature on its device, if any."""
        if not problem.device.detected:
            return None
        return self._table(problem.device)[2].get(tuning_key(problem))

    # --- ranking ------------------------------------------------------------------

    def apply(self, decision: Decision) -> Decision:
        """A declared-priority decision re-ranked by stored times (eligible backends only,
        each keeping the slots eligible backends had), or marked pending measurement."""
        problem = decision.problem
        eligible = [c for c in decision.candidates if c.eligible]
        if not eligible or (len(eligible) < 2 and not self._offers_configs(eligible[0].name)):
            return decision
        tuning = self.lookup(problem)
        if tuning is None or not {c.name for c in eligible} <= tuning.backends():
            return dataclasses.replace(decision, tune_pending=not problem.capturing and problem.device.detected)
        rank = {c.name: i for i, c in enumerate(eligible)}
        chosen = choose(tuning.timings, rank, close=tuning.close_call)
        if chosen is None:
            return dataclasses.replace(decision, tuning=tuning)
        if not self._runs_config(chosen.backend, chosen.config, problem):
            # A stored config this backend does not offer now (another release, a hand edit)
            # would fail inside the backend's run: measure again instead.
            warnings.warn(
                f"ignoring the stored autotune choice {chosen.label} for {problem}: "
                f"{chosen.backend} does not offer that config here; measuring again",
                tuning_store.AutotuneCacheWarning,
                stacklevel=2,
            )
            return dataclasses.replace(decision, tune_pending=not problem.capturing and problem.device.detected)
        if tuning.origin == "loaded":
            with self._lock:
                self._loaded_used.add((self._file(problem.device)[0], tuning.key))

        def order(c: Candidate) -> tuple[int, float, int]:
            if c.name == chosen.backend:
                return (0, 0.0, rank[c.name])
            best = tuning.fastest_ms(c.name)
            return (1, math.inf if best is None else best, rank[c.name])

        tuned = iter(sorted(eligible, key=order))
        candidates = tuple(next(tuned) if c.eligible else c for c in decision.candidates)
        return dataclasses.replace(
            decision, candidates=candidates, selected=chosen.backend, config=chosen.config, tuning=tuning
        )

    @classmethod
    def _serves(cls, tuning: Tuning, eligible: list[Candidate], problem: Problem) -> bool:
        """Whether ``apply`` takes ``tuning`` as it is: it timed every eligible backend and
        its winner's config is offered now. One it refuses (a config not offered) must be
        measured again, not returned: it stayed, and every call warned and ran untuned."""
        if not {c.name for c in eligible} <= tuning.backends():
            return False
        chosen = choose(tuning.timings, {c.name: i for i, c in enumerate(eligible)}, close=tuning.close_call)
        return chosen is None or cls._runs_config(chosen.backend, chosen.config, problem)

    @staticmethod
    def _runs_config(name: str, config: Config | None, problem: Problem) -> bool:
        """Whether backend ``name`` offers ``config`` for ``problem`` now (None: its default
        run, always)."""
        if config is None:
            return True
        try:
            offered = _configs(registry().get(name).backend, problem)
        except PLUGIN_ERRORS:  # unregistered, no run_config, a failing configs(): not offered
            return False
        return any(_same_config(config, c) for c in offered)

    @staticmethod
    def _offers_configs(name: str) -> bool:
        """Whether backend ``name`` offers kernel configs (False once it is unregistered:
        another thread may do that between a decision and this look)."""
        try:
            backend = registry().get(name).backend
        except UnknownBackendError:
            return False
        return callable(getattr(backend, "configs", None))

    # --- measuring ----------------------------------------------------------------

    def measure(
        self,
        problem: Problem,
        inputs: GroupedInputs,
        decision: Decision,
        plan: Plan | None = None,
        close_plan: ClosePlan | None = None,
    ) -> Tuning:
        """Time every eligible contender of a pending decision on the call's operands,
        store and persist the outcome. The caller's ``out`` is never written."""
        plan = plan or PLAN
        close_plan = close_plan or CLOSE_PLAN
        device = getattr(inputs.a, "device", None)
        on_device = torch.cuda.device(device) if problem.placement == "cuda" else contextlib.nullcontext()
        with self._lock, torch.no_grad(), on_device:
            stored = self.lookup(problem)
            eligible = [c for c in decision.candidates if c.eligible]
            if stored is not None and self._serves(stored, eligible, problem):
                return stored  # another thread measured it meanwhile
            started = time.perf_counter()
            contenders, excluded = self._contenders(problem, inputs, eligible)
            clock = Clock(problem.placement == "cuda")
            self._check_agreement(problem, inputs, contenders, clock)
            live = [c for c in contenders if not c.note]
            self._time(problem, inputs, live, clock, plan)
            close_call = self._resolve_close(problem, inputs, [c for c in live if not c.note], clock, close_plan)
            clock.sync()
            cost_ms = (time.perf_counter() - started) * 1e3
            timings = tuple(excluded + [c.timing() for c in contenders])
            order = {c.name: i for i, c in enumerate(eligible)}
            timings = tuple(sorted(timings, key=lambda t: order[t.backend]))
            chosen = choose(timings, order, close=close_call)
            tuning = Tuning(
                key=tuning_key(problem),
                problem=str(problem),
                m=problem.m,
                choice=chosen.backend if chosen else (decision.selected or ""),
                config=chosen.config if chosen else None,
                priority_choice=decision.selected or "",
                timings=timings,
                cost_ms=cost_ms,
                measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                close_call=close_call,
            )
            self.tuned += 1
            self.close_calls += close_call is not None
            self.calls += sum(c.calls for c in contenders)
            self.cost_ms += cost_ms
            path, header, table = self._table(problem.device)
            table[tuning.key] = tuning
            tuning_store.save(path, header, {tuning.key: tuning})
        LOGGER.info("grouped_gemm autotune: %s -> %s (%.1f ms of tuning)", problem, tuning.choice, cost_ms)
        return tuning

    @staticmethod
    def _contenders(
        problem: Problem, inputs: GroupedInputs, eligible: list[Candidate]
    ) -> tuple[list[_Contender], list[Timing]]:
        """Every eligible backend, then each of its configs; a broken hook excludes it."""
        contenders: list[_Contender] = []
        excluded: list[Timing] = []
        reg = registry()
        for candidate in eligible:
            try:
                entry = reg.get(candidate.name)
            except UnknownBackendError:  # unregistered (another thread) since the decision
                excluded.append(Timing(candidate.name, None, None, 0, "unregistered while tuning"))
                continue
            backend = entry.backend
            unready = prepared_reasons(entry, problem)
            if unready:  # e.g. its kernels failed to build
                excluded.append(Timing(candidate.name, None, None, 0, "prepare(): " + "; ".join(map(str, unready))))
                continue
            try:
                configs = _configs(backend, problem)
            except PLUGIN_ERRORS as exc:  # a broken plugin hook excludes only it
                excluded.append(Timing(candidate.name, None, None, 0, f"configs(): {type(exc).__name__}: {exc}"))
                continue
            contenders += [_Contender(candidate.name, backend, config) for config in [None, *configs]]
        return contenders, excluded

    @staticmethod
    def _check_agreement(problem: Problem, inputs: GroupedInputs, contenders: list[_Contender], clock: Clock) -> None:
        """Run each contender once (compiling / warming it) and exclude those that raise
        or disagree with the contender most others agree with (ties: declared rank)."""
        results: list[tuple[_Contender, torch.Tensor]] = []
        for c in contenders:
            try:
                c.scratch = _scratch(problem, inputs.out)
                results.append((c, _as_tensor(c.call(problem, inputs))))
                clock.sync()
            except PLUGIN_ERRORS as exc:  # measured failures exclude, never propagate
                c.note = f"raised {type(exc).__name__}: {exc}"
        if len(results) < 2:
            return
        floor = agreement_floor_db(problem.out_dtype)
        first = results[0][1]
        if all(agreement_db(first, r) >= floor for _, r in results[1:]):
            return
        n = len(results)
        db = [[math.inf if i == j else agreement_db(results[i][1], results[j][1]) for j in range(n)] for i in range(n)]
        anchor = max(range(n), key=lambda i: (sum(v >= floor for v in db[i]), -i))
        for j in range(n):
            if db[anchor][j] < floor:
                results[j][
                    0
                ].note = f"disagrees with {results[anchor][0].label}: SQNR {db[anchor][j]:.1f} dB < {floor:.1f} dB"

    @staticmethod
    def _time(problem: Problem, inputs: GroupedInputs, live: list[_Contender], clock: Clock, plan: Plan) -> None:
        """Probe, prune the clearly slower, then time the rest in rotating rounds."""
        for c in live:
            try:
                clock.sync()
                stamps = []
                for _ in range(plan.probe_calls):
                    start = clock.stamp()
                    c.call(problem, inputs)
                    stamps.append((start, clock.stamp()))
                clock.sync()
                c.estimate_ms = min(clock.ms(s, e) for s, e in stamps)  # one hiccup must not prune
            except PLUGIN_ERRORS as exc:
                c.note = f"raised {type(exc).__name__}: {exc}"
        live = [c for c in live if not c.note]
        if not live:
            return
        fastest = min(c.estimate_ms for c in live)
        for c in live:
            if c.estimate_ms > PRUNE_FACTOR * fastest:
                c.note = f"pruned: probe {c.estimate_ms / max(fastest, 1e-9):.1f}x the fastest"
        live = [c for c in live if not c.note]
        for r in range(plan.rounds):
            turn = live[r % len(live) :] + live[: r % len(live)]
            for c in turn:
                warmup, reps = plan.block(c.estimate_ms, first=r == 0)
                try:
                    for _ in range(warmup):
                        c.call(problem, inputs)
                    stamps = []
                    for _ in range(reps):
                        start = clock.stamp()
                        c.call(problem, inputs)
                        stamps.append((start, clock.stamp()))
                    clock.sync()
                except PLUGIN_ERRORS as exc:
                    c.note = f"raised {type(exc).__name__}: {exc}"
                    continue
                c.times += [clock.ms(s, e) for s, e in stamps]
            live = [c for c in live if not c.note]
            if not live:
                return

    @staticmethod
    def _resolve_close(
        problem: Problem, inputs: GroupedInputs, timed: list[_Contender], clock: Clock, plan: ClosePlan
    ) -> CloseCall | None:
        """Time the contenders within ``CLOSE_MARGIN`` of the fastest again, interleaved;
        their times become ``paired_ms`` of that. As close ones beyond ``CLOSE_MAX`` are
        pruned. None when no other contender is that close, or one raised (it is
        excluded, the others keep their rounds)."""
        medians = {c.label: _median(c.times) for c in timed if c.times}
        close = close_to_fastest(medians, backends={c.label: c.name for c in timed})
        if not close:
            return None
        fastest = medians[close[0]]
        for c in timed:
            if c.label not in close and medians.get(c.label, math.inf) <= fastest * (1.0 + CLOSE_MARGIN):
                c.estimate_ms = medians[c.label]
                c.note = f"pruned: within {100 * CLOSE_MARGIN:.0f} % but behind {CLOSE_MAX} closer contenders"
        chosen = [next(c for c in timed if c.label == label) for label in close]

        def runner(c: _Contender) -> Callable[[int], object]:
            def run(_: int) -> object:
                try:
                    return c.call(problem, inputs)
                except PLUGIN_ERRORS as exc:
                    c.note = f"raised {type(exc).__name__}: {exc}"
                    raise

            return run

        before = sum(c.calls for c in chosen)
        try:
            blocks, _ = interleave([runner(c) for c in chosen], max(medians[label] for label in close), clock, plan)
        except PLUGIN_ERRORS:  # the raising contender is excluded, the others keep their rounds
            return None
        for c, per_block, ms in zip(chosen, blocks, paired_ms(blocks, medians[close[0]]), strict=True):
            c.times = [ms for block in per_block for ms in block]
            c.paired_ms = ms
        first = min(range(len(chosen)), key=lambda j: timed.index(chosen[j]))  # declared rank
        ties = [chosen[first].label] + [
            c.label
            for j, c in enumerate(chosen)
            if j != first and pair_wins(blocks[j], blocks[first]) < CONSISTENT_WINS
        ]
        return CloseCall(
            tuple(close),
            tuple(medians[label] for label in close),
            CLOSE_MARGIN,
            sum(c.calls for c in chosen) - before,
            tuple(ties) if len(ties) > 1 else (),
        )

    # --- statistics ---------------------------------------------------------------

    def counters(self) -> dict[str, Any]:
        """Signatures tuned in this process (and how many were close calls), stored
        ones used, calls made while measuring, and the wall time measuring took."""
        with self._lock:
            return {
                "tuned": self.tuned,
                "close_calls": self.close_calls,
                "loaded": len(self._loaded_used),
                "calls": self.calls,
                "tuning_ms": round(self.cost_ms, 3),
            }

    def reset_counters(self) -> None:
        with self._lock:
            self.tuned = 0
            self.close_calls = 0
            self.calls = 0
            self.cost_ms = 0.0
            self._loaded_used.clear()


TUNER = Tuner()
