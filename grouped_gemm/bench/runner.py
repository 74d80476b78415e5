"""The sweep: every selected (case, splits, recipe, op), every eligible backend and the peer.

Backends are called through the public API with ``backend=<name>`` inside a strict
scope, so timings include validation and dispatch and a backend that turns out not to
be eligible raises instead of silently timing another one. Each output is checked
against a sampled float64 reference before it is timed.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from typing import Any

import torch

import grouped_gemm as gg
from grouped_gemm.bench import accuracy, metrics, peer
from grouped_gemm.bench.ceilings import Ceilings, matmul_kind
from grouped_gemm.bench.operands import DTYPES, OperandSets, make_operands
from grouped_gemm.bench.shapes import Case
from grouped_gemm.bench.timing import CALL_ERRORS, TimingPlan, median, time_in_rounds
from grouped_gemm.problem import Op, Problem
from grouped_gemm.testing import same_function, sqnr_floor
from grouped_gemm.tools import Progress, prequantized_weight

_API = {"fwd": gg.grouped_gemm, "dgrad": gg.grouped_gemm_dgrad, "wgrad": gg.grouped_gemm_wgrad}


#: How MX recipes get their fwd / dgrad weights (``--mx-weights``): high precision, quantized
#: inside each call as in training; pre-quantized ``MXTensor`` as in inference; or both.
MX_WEIGHTS = ("per-call", "prequantized", "both")


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """What to run. ``backends``: ``"eligible"`` (every eligible backend but the slow
    ``reference``), ``"all"`` (reference too) or a tuple of names. ``mx_weights``: one of
    ``MX_WEIGHTS``."""

    cases: tuple[Case, ...]
    ops: tuple[Op, ...]
    splits: tuple[str, ...]
    recipes: tuple[str, ...]
    backends: str | tuple[str, ...] = "eligible"
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    plan: TimingPlan = dataclasses.field(default_factory=TimingPlan)
    verify: bool = True
    peer: bool = True
    mx_weights: str = "per-call"
    device_splits: bool = False
    seed: int = 0

    @property
    def prequantized_weights(self) -> bool:
        return self.mx_weights != "per-call"

    def weight_modes(self, recipe: str, op: Op) -> tuple[str, ...]:
        """How the problem's weight is passed, one run each: ``"per-call"`` /
        ``"prequantized"`` for an MX recipe's fwd and dgrad, else ``""`` (high precision)."""
        if op == "wgrad" or not gg.get_recipe(recipe).is_mx:
            return ("",)
        return ("per-call", "prequantized") if self.mx_weights == "both" else (self.mx_weights,)

    @property
    def problems(self) -> int:
        per_case = sum(len(self.weight_modes(r, op)) for r in self.recipes for op in self.ops)
        return len(self.cases) * len(self.splits) * per_case


@dataclasses.dataclass
class Row:
    """One backend (or the peer) on one problem: every raw figure and what it means."""

    case: str
    groups: int
    m: int
    n: int
    k: int
    splits: str
    op: str
    recipe: str
    backend: str
    role: str  # "backend" or "peer"
    weights: str  # MX fwd / dgrad: "per-call" or "prequantized"; otherwise ""
    status: str  # "ok", "wrong" (failed the accuracy check), "error", "skipped"
    note: str = ""
    times_ms: list[float] = dataclasses.field(default_factory=list)
    round_medians_ms: list[float] = dataclasses.field(default_factory=list)
    median_ms: float | None = None
    host_us: float | None = None  # median host time per timed call (dispatch and launches)
    tflops: float | None = None
    gbs: float | None = None
    pct_of_ceiling: float | None = None
    vs_peer: float | None = None
    sqnr_db: float | None = None
    sqnr_floor_db: float | None = None
    operand_sets: int = 0
    flops: float = 0.0
    bytes: float = 0.0


@dataclasses.dataclass
class Job:
    """One problem of the sweep: what its rows share."""

    case: Case
    splits_kind: str
    recipe: str
    op: Op
    weights: str = ""

    def row(self, backend: str, role: str, status: str, **fields: Any) -> Row:
        c = self.case
        return Row(
            case=c.name,
            groups=c.groups,
            m=c.m,
            n=c.n,
            k=c.k,
            splits=self.splits_kind,
            op=self.op,
            recipe=self.recipe,
            backend=backend,
            role=role,
            weights=self.weights,
            status=status,
            **fields,
        )

    @property
    def label(self) -> str:
        weights = f" ({self.weights} weights)" if self.weights else ""
        return f"{self.case.name} {self.splits_kind} {self.op} {self.recipe}{weights}"


@dataclasses.dataclass
class SweepResult:
    """Every row of a run, and which backend was not eligible for which problem and why."""

    rows: list[Row]
    ineligible: list[dict[str, Any]]


def _input_dtype(recipe: str) -> torch.dtype:
    return DTYPES[gg.get_recipe(recipe).plain_dtype or "bfloat16"]


def _selected(decision: gg.Decision, wanted: str | tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """(backends to time, {backend: why not} for named or eligible-elsewhere backends)."""
    skipped = {c.name: "; ".join(str(r) for r in c.reasons) for c in decision.candidates if not c.eligible}
    if wanted == "all":
        return [c.name for c in decision.candidates if c.eligible], skipped
    if wanted == "eligible":
        return [c.name for c in decision.candidates if c.eligible and c.name != "reference"], skipped
    return [n for n in wanted if n not in skipped], skipped


def _error_note(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


@dataclasses.dataclass
class Contender:
    """A backend (or the peer) ready to time on one problem."""

    row: Row
    fn: Callable[[int], Any]
    sets: int
    problem: Problem
    kind: str


def _output_shape(problem: Problem) -> tuple[int, ...]:
    return {
        "fwd": (problem.m, problem.n),
        "dgrad": (problem.m, problem.k),
        "wgrad": (problem.groups, problem.n, problem.k),
    }[problem.op]


def _first_call(c: Contender, sample: accuracy.Sample | None, floor: float) -> None:
    """Run once on set 0; record the SQNR of the sampled entries, or the error."""
    try:
        out = c.fn(0)
    except CALL_ERRORS as exc:
        c.row.status, c.row.note = "error", _error_note(exc)
        return
    shape = _output_shape(c.problem)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        c.row.status, c.row.note = "error", f"returned {got}, expected a tensor of shape {shape}"
    elif sample is not None:
        c.row.sqnr_db = sample.sqnr(out)
        c.row.sqnr_floor_db = floor


def _time(contenders: list[Contender], device: torch.device, plan: TimingPlan) -> None:
    """Time the contenders that ran once without error, in blocks taken in turn."""
    live = [c for c in contenders if c.row.status != "error"]
    for c, timed in zip(live, time_in_rounds([c.fn for c in live], [c.sets for c in live], device, plan), strict=True):
        c.row.operand_sets = c.sets
        if timed.error is not None:
            c.row.status, c.row.note = "error", _error_note(timed.error)
        else:
            c.row.times_ms, c.row.round_medians_ms = timed.times_ms, timed.round_medians_ms
            c.row.host_us = median(timed.host_us) if timed.host_us else None


def _finish(c: Contender, ceilings: Ceilings, live_groups: int) -> None:
    """Median, rates and verdict of a timed contender."""
    row = c.row
    row.flops = float(c.problem.flops)
    row.bytes = metrics.bytes_moved(c.problem, live_groups)
    if row.status == "error" or not row.times_ms:
        return
    row.median_ms = median(row.times_ms)
    r = metrics.rates(row.flops, row.bytes, row.median_ms, ceilings.matmul_tflops.get(c.kind), ceilings.copy_gbs)
    row.tflops, row.gbs, row.pct_of_ceiling = r.tflops, r.gbs, r.pct_of_ceiling
    if row.sqnr_db is not None and not row.sqnr_db >= row.sqnr_floor_db:
        row.status = "wrong"
        row.note = f"SQNR {row.sqnr_db:.1f} dB below the {row.sqnr_floor_db:.1f} dB floor: results are wrong"
    else:
        row.status = "ok"


class Sweep:
    """Runs ``BenchOptions`` and collects rows; one instance per run."""

    def __init__(self, opts: BenchOptions, ceilings: Ceilings, progress: Progress) -> None:
        self.opts = opts
        self.ceilings = ceilings
        self.progress = progress
        self.result = SweepResult(rows=[], ineligible=[])

    def run(self) -> SweepResult:
        with gg.use_backends(strict=True):
            for case in self.opts.cases:
                for kind in self.opts.splits:
                    for recipe in self.opts.recipes:
                        for op in self.opts.ops:
                            for weights in self.opts.weight_modes(recipe, op):
                                job = Job(case, kind, recipe, op, weights)
                                self.progress.step(job.label)
                                self._problem(job)
                                _release(self.opts.device)
        self.progress.close()
        return self.result

    def _skip(self, job: Job, note: str) -> None:
        self.result.rows.append(job.row("-", "backend", "skipped", note=note))

    def _problem(self, job: Job) -> None:
        opts = self.opts
        splits = job.case.splits(job.splits_kind)
        operands = make_operands(job.op, job.case, splits, _input_dtype(job.recipe), opts.device, opts.seed)
        reference_b = operands.first.b
        if job.weights == "prequantized":
            why, reference_b = _prequantize(job, operands)
            if why is not None:
                return self._skip(job, f"--prequantized-weights: {why}")
        m_splits = torch.tensor(splits, device=opts.device) if opts.device_splits else splits
        first = operands.first
        try:
            decision = gg.explain(first.a, first.b, m_splits, op=job.op, recipe=job.recipe)
        except gg.GroupedGemmError as exc:
            if reference_b is first.b:
                raise
            return self._skip(job, f"--prequantized-weights: the API refused the MXTensor weight: {exc}")
        names, skipped = _selected(decision, opts.backends)
        for name, why in skipped.items():
            self.result.ineligible.append({"problem": job.label, "backend": name, "reasons": why})
        if isinstance(opts.backends, tuple):
            for name in (n for n in opts.backends if n in skipped):
                self.result.rows.append(job.row(name, "backend", "skipped", note=f"not eligible: {skipped[name]}"))
        sample = accuracy.sample_reference(job.op, first.a, reference_b, splits, opts.seed) if opts.verify else None
        same = same_function(job.recipe, job.op, prequantized_weight=reference_b is not first.b)
        floor = sqnr_floor(decision.problem.out_dtype, job.recipe, same_function=same)
        contenders = []
        kind = matmul_kind(job.recipe)
        for name in names:
            api = _API[job.op]
            fn = lambda i, api=api, name=name: api(  # noqa: E731
                operands.sets[i].a, operands.sets[i].b, m_splits, recipe=job.recipe, backend=name
            )
            c = Contender(job.row(name, "backend", "ok"), fn, len(operands.sets), decision.problem, kind)
            _first_call(c, sample, floor)
            contenders.append(c)
        if opts.peer:
            contenders += self._peer(job, splits, operands, sample, decision.problem)
        _time(contenders, opts.device, opts.plan)
        live_groups = sum(1 for rows in splits if rows)
        for c in contenders:
            _finish(c, self.ceilings, live_groups)
        peer_ms = next((c.row.median_ms for c in contenders if c.row.role == "peer" and c.row.status == "ok"), None)
        for c in contenders:
            self.result.rows.append(c.row)
            if c.row.role == "backend" and c.row.median_ms and peer_ms:
                c.row.vs_peer = peer_ms / c.row.median_ms

    def _peer(
        self, job: Job, splits: list[int], operands: OperandSets, sample: accuracy.Sample | None, problem: Problem
    ) -> list[Contender]:
        """The peer as a contender (on its own bf16 operands unless the problem's are bf16)."""
        opts = self.opts
        why = peer.available()
        if why is not None:
            self.result.rows.append(job.row(peer.NAME, "peer", "skipped", note=why))
            return []
        if job.recipe != "bf16" or job.weights == "prequantized":
            operands = make_operands(job.op, job.case, splits, torch.bfloat16, opts.device, opts.seed)
            if opts.verify:
                first = operands.first
                sample = accuracy.sample_reference(job.op, first.a, first.b, splits, opts.seed)
        offs = peer.group_ends(splits, opts.device)
        bf16 = dataclasses.replace(
            problem, recipe="bf16", a_format="bfloat16", b_format="bfloat16", out_dtype="bfloat16"
        )
        c = Contender(
            job.row(peer.NAME, "peer", "ok"), peer.runner(job.op, operands.sets, offs), len(operands.sets), bf16, "bf16"
        )
        _first_call(c, sample, sqnr_floor("bfloat16", "bf16", same_function=True))
        return [c]


def _prequantize(job: Job, operands: OperandSets) -> tuple[str | None, torch.Tensor]:
    """Replace every set's weight by its MXTensor, quantized along the op's contraction
    dimension (K for fwd, N for dgrad) with the recipe's scale rule; (why not, or None;
    the dequantized weight, for the float64 reference)."""
    original = operands.first.b
    try:
        for s in operands.sets:
            s.b = prequantized_weight(s.b, job.recipe, job.op)
        return None, operands.first.b.dequantize()
    except (*CALL_ERRORS, AttributeError) as exc:
        return f"quantizing the weight failed: {_error_note(exc)}", original


def _release(device: torch.device) -> None:
    """Give freed operand memory back between problems (their sizes vary by 100x)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
