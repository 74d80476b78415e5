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
from grouped_gemm.bench import accuracy, metrics, mx_weights, peer
from grouped_gemm.bench.ceilings import Ceilings, matmul_kind
from grouped_gemm.bench.operands import DTYPES, OperandSets, make_operands
from grouped_gemm.bench.progress import Progress
from grouped_gemm.bench.shapes import Case
from grouped_gemm.bench.timing import TimingPlan, median, time_calls
from grouped_gemm.check import sqnr_floor
from grouped_gemm.problem import Op, Problem

_API = {"fwd": gg.grouped_gemm, "dgrad": gg.grouped_gemm_dgrad, "wgrad": gg.grouped_gemm_wgrad}


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """What to run. ``backends``: ``"eligible"`` (every eligible backend but the slow
    ``reference``), ``"all"`` (reference too) or a tuple of names."""

    cases: tuple[Case, ...]
    ops: tuple[Op, ...]
    splits: tuple[str, ...]
    recipes: tuple[str, ...]
    backends: str | tuple[str, ...] = "eligible"
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    plan: TimingPlan = dataclasses.field(default_factory=TimingPlan)
    verify: bool = True
    peer: bool = True
    prequantized_weights: bool = False
    device_splits: bool = False
    seed: int = 0

    @property
    def problems(self) -> int:
        return len(self.cases) * len(self.splits) * len(self.recipes) * len(self.ops)


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
    status: str  # "ok", "wrong" (failed the accuracy check), "error", "skipped"
    note: str = ""
    times_ms: list[float] = dataclasses.field(default_factory=list)
    median_ms: float | None = None
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
            status=status,
            **fields,
        )

    @property
    def label(self) -> str:
        return f"{self.case.name} {self.splits_kind} {self.op} {self.recipe}"


@dataclasses.dataclass
class SweepResult:
    rows: list[Row]
    ineligible: list[dict[str, Any]]
    notes: list[str]


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


def _measure(
    fn: Callable[[int], Any],
    sets: int,
    sample: accuracy.Sample | None,
    floor: float,
    opts: BenchOptions,
) -> dict[str, Any]:
    """Run once and check it, then time it; the fields of its Row."""
    fields: dict[str, Any] = {"operand_sets": sets}
    try:
        out = fn(0)
        if sample is not None:
            fields["sqnr_db"] = sample.sqnr(out)
            fields["sqnr_floor_db"] = floor
        del out
        fields["times_ms"] = time_calls(fn, sets, opts.device, opts.plan)
    except (gg.GroupedGemmError, RuntimeError, ValueError, TypeError) as exc:
        fields["status"] = "error"
        fields["note"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return fields
    fields["median_ms"] = median(fields["times_ms"])
    wrong = sample is not None and not fields["sqnr_db"] >= floor
    fields["status"] = "wrong" if wrong else "ok"
    if wrong:
        fields["note"] = f"SQNR {fields['sqnr_db']:.1f} dB below the {floor:.1f} dB floor: results are wrong"
    return fields


def _fill_rates(row: Row, problem: Problem, ceilings: Ceilings, kind: str) -> None:
    row.flops = float(problem.flops)
    row.bytes = metrics.bytes_moved(problem)
    if row.median_ms:
        r = metrics.rates(row.flops, row.bytes, row.median_ms, ceilings.matmul_tflops.get(kind), ceilings.copy_gbs)
        row.tflops, row.gbs, row.pct_of_ceiling = r.tflops, r.gbs, r.pct_of_ceiling


class Sweep:
    """Runs ``BenchOptions`` and collects rows; one instance per run."""

    def __init__(self, opts: BenchOptions, ceilings: Ceilings, progress: Progress) -> None:
        self.opts = opts
        self.ceilings = ceilings
        self.progress = progress
        self.result = SweepResult(rows=[], ineligible=[], notes=[])

    def run(self) -> SweepResult:
        with gg.use_backends(strict=True):
            for case in self.opts.cases:
                for kind in self.opts.splits:
                    for recipe in self.opts.recipes:
                        for op in self.opts.ops:
                            p = Job(case, kind, recipe, op)
                            self.progress.step(p.label)
                            self._problem(p)
                            _release(self.opts.device)
        self.progress.close()
        return self.result

    def _m_splits(self, splits: list[int]) -> list[int] | torch.Tensor:
        if self.opts.device_splits:
            return torch.tensor(splits, dtype=torch.int64, device=self.opts.device)
        return splits

    def _problem(self, p: Job) -> None:
        opts = self.opts
        first_row = len(self.result.rows)
        splits = p.case.splits(p.splits_kind)
        operands = make_operands(p.op, p.case, splits, _input_dtype(p.recipe), opts.device, opts.seed)
        reference_b = operands.first.b
        if opts.prequantized_weights and gg.get_recipe(p.recipe).is_mx and p.op != "wgrad":
            why = mx_weights.unavailable(p.recipe, p.op)
            if why is None:
                why, reference_b = self._prequantize(p, operands)
            if why is not None:
                self.result.rows.append(p.row("-", "backend", "skipped", note=f"--prequantized-weights: {why}"))
                return
        m_splits = self._m_splits(splits)
        first = operands.first
        try:
            decision = gg.explain(first.a, first.b, m_splits, op=p.op, recipe=p.recipe)
        except gg.GroupedGemmError as exc:
            if reference_b is first.b:
                raise
            note = f"--prequantized-weights: the API refused the MXTensor weight: {exc}"
            self.result.rows.append(p.row("-", "backend", "skipped", note=note))
            return
        names, skipped = _selected(decision, opts.backends)
        for name, why in skipped.items():
            self.result.ineligible.append({"problem": p.label, "backend": name, "reasons": why})
        if isinstance(opts.backends, tuple):
            for name in (n for n in opts.backends if n in skipped):
                self.result.rows.append(p.row(name, "backend", "skipped", note=f"not eligible: {skipped[name]}"))
        sample = accuracy.sample_reference(p.op, first.a, reference_b, splits, opts.seed) if opts.verify else None
        same = not gg.get_recipe(p.recipe).is_mx
        floor = sqnr_floor(decision.problem.out_dtype, p.recipe, same_function=same)
        kind = matmul_kind(p.recipe)
        for name in names:
            api = _API[p.op]
            fn = lambda i, api=api, name=name: api(  # noqa: E731
                operands.sets[i].a, operands.sets[i].b, m_splits, recipe=p.recipe, backend=name
            )
            fields = _measure(fn, len(operands.sets), sample, floor, opts)
            row = p.row(name, "backend", **fields)
            _fill_rates(row, decision.problem, self.ceilings, kind)
            self.result.rows.append(row)
        if opts.peer:
            self._peer(p, splits, operands, sample, decision.problem, first_row)

    def _prequantize(self, p: Job, operands: OperandSets) -> tuple[str | None, torch.Tensor]:
        original = operands.first.b
        try:
            for s in operands.sets:
                s.b = mx_weights.quantize_weight(s.b, p.recipe, p.op)
            return None, mx_weights.dequantized(operands.first.b, original)
        except (gg.GroupedGemmError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
            return f"quantizing the weight failed: {type(exc).__name__}: {exc}", original

    def _peer(
        self,
        p: Job,
        splits: list[int],
        operands: OperandSets,
        sample: accuracy.Sample | None,
        problem: Problem,
        first_row: int,
    ) -> None:
        opts = self.opts
        why = peer.available()
        if why is not None:
            self.result.rows.append(p.row(peer.NAME, "peer", "skipped", note=why))
            return
        plain_bf16 = p.recipe == "bf16" and not opts.prequantized_weights
        if not plain_bf16:
            operands = make_operands(p.op, p.case, splits, torch.bfloat16, opts.device, opts.seed)
            if opts.verify:
                first = operands.first
                sample = accuracy.sample_reference(p.op, first.a, first.b, splits, opts.seed)
        offs = peer.group_ends(splits, opts.device)
        floor = sqnr_floor("bfloat16", "bf16", same_function=True)
        fields = _measure(peer.runner(p.op, operands.sets, offs), len(operands.sets), sample, floor, opts)
        row = p.row(peer.NAME, "peer", **fields)
        bf16 = dataclasses.replace(problem, recipe="bf16", a_format="bfloat16", b_format="bfloat16")
        _fill_rates(row, dataclasses.replace(bf16, out_dtype="bfloat16"), self.ceilings, "bf16")
        self.result.rows.append(row)
        for other in self.result.rows[first_row:]:
            if other.role == "backend" and other.median_ms and row.median_ms:
                other.vs_peer = row.median_ms / other.median_ms


def _release(device: torch.device) -> None:
    """Give freed operand memory back between problems (their sizes vary by 100x)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
