"""Benchmark output: the terminal table, the JSON record, and a Markdown table for docs.

The JSON keeps every raw figure (each timed call, the ceilings, the environment) so
that later readers can recompute anything; the tables are views of it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import textwrap
from pathlib import Path
from typing import Any

from grouped_gemm.bench.ceilings import Ceilings
from grouped_gemm.bench.runner import BenchOptions, Row, SweepResult

SCHEMA = "grouped_gemm.bench/1"


def document(
    opts: BenchOptions, environment: dict[str, Any], ceilings: Ceilings, result: SweepResult, elapsed_s: float
) -> dict[str, Any]:
    """The JSON record of a run."""
    return {
        "schema": SCHEMA,
        "environment": environment,
        "options": {
            "cases": [dataclasses.asdict(c) for c in opts.cases],
            "ops": list(opts.ops),
            "splits": list(opts.splits),
            "recipes": list(opts.recipes),
            "backends": opts.backends if isinstance(opts.backends, str) else list(opts.backends),
            "device": str(opts.device),
            "timing": dataclasses.asdict(opts.plan),
            "verify": opts.verify,
            "peer": opts.peer,
            "prequantized_weights": opts.prequantized_weights,
            "mx_weights": opts.mx_weights,
            "device_splits": opts.device_splits,
            "seed": opts.seed,
        },
        "ceilings": dataclasses.asdict(ceilings),
        "elapsed_s": elapsed_s,
        "rows": [dataclasses.asdict(r) for r in result.rows],
        "ineligible": result.ineligible,
    }


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, allow_nan=False, default=_jsonable) + "\n", encoding="utf-8")


def _jsonable(value: Any) -> Any:
    return str(value)


def _num(value: float | None, digits: int = 1) -> str:
    if value is None or not math.isfinite(value):
        return "-" if value is None else ("exact" if value > 0 else "-inf")
    return f"{value:.{digits}f}"


def _sig(value: float | None) -> str:
    """Three significant digits, without exponent notation (0.0123, 1.23, 123, 1234)."""
    if value is None or not math.isfinite(value):
        return _num(value)
    if value == 0 or abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.{max(0, 2 - math.floor(math.log10(abs(value))))}f}"


_CHECK = {"ok": "ok", "wrong": "WRONG", "error": "error", "skipped": "skipped"}

#: Timed calls of one backend that differ by more than this factor, in a run of a single
#: round, measured the machine's load rather than the backend (a shared CPU does this).
UNRELIABLE_SPREAD = 2.0
#: Columns the footer wraps to.
WIDTH = 100


def unreliable(r: Row) -> bool:
    """Whether a row's timing is not a figure to quote: one round whose calls disagree by
    more than UNRELIABLE_SPREAD (several rounds give a median the load can move less)."""
    times = [t for t in r.times_ms if t > 0]
    if r.status != "ok" or len(r.round_medians_ms) > 1 or not times:
        return False
    return len(times) < 2 or max(times) / min(times) > UNRELIABLE_SPREAD


def _row_cells(r: Row, peer: Row | None) -> list[str]:
    mark = "?" if unreliable(r) else ""
    over = "?" if r.pct_of_ceiling is not None and r.pct_of_ceiling > 100 else ""
    ratio = ""
    if r.status == "ok":
        ratio = _num(r.vs_peer, 2) + ("?" if r.vs_peer is not None and (mark or (peer and unreliable(peer))) else "")
    return [
        r.backend,
        _sig(r.median_ms) + mark,
        _num(r.host_us),
        _sig(r.tflops) + mark,
        _sig(r.gbs) + mark,
        _num(r.pct_of_ceiling) + (mark or over),
        ratio,
        _num(r.sqnr_db),
        _CHECK.get(r.status, r.status),
    ]


def _problem_key(r: Row) -> tuple:
    return (r.case, r.splits, r.op, _recipe_cell(r))


def _recipe_cell(r: Row) -> str:
    """The recipe, and for MX fwd / dgrad how the weight was passed (``w:per-call``: high
    precision, quantized inside the call; ``w:prequantized``: an MXTensor)."""
    return f"{r.recipe} w:{r.weights}" if r.weights else r.recipe


def table(rows: list[Row]) -> str:
    """Fixed-width table, one line per backend and problem (problem columns on its first line)."""
    head = [
        "case",
        "G",
        "M",
        "N",
        "K",
        "splits",
        "op",
        "recipe",
        "backend",
        "ms",
        "host us",
        "TFLOP/s",
        "GB/s",
        "%ceil",
    ]
    out = [[*head, "vs peer", "SQNR dB", "check"]]
    peers = {_problem_key(r): r for r in rows if r.role == "peer"}
    last = None
    for r in rows:
        key = _problem_key(r)
        first = key != last
        last = key
        problem = [r.case, str(r.groups), str(r.m), str(r.n), str(r.k), r.splits, r.op, _recipe_cell(r)]
        out.append((problem if first else [""] * len(problem)) + _row_cells(r, peers.get(key)))
    widths = [max(len(line[i]) for line in out) for i in range(len(out[0]))]
    numeric = set(range(1, 5)) | set(range(9, 16))
    lines = []
    for line in out:
        cells = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def reliability_note(rows: list[Row]) -> list[str]:
    """What a ``?`` in the table means, when there is one."""
    flagged = sum(unreliable(r) for r in rows)
    over = sum(r.pct_of_ceiling is not None and r.pct_of_ceiling > 100 for r in rows)
    if not flagged and not over:
        return []
    text = "?: not a figure to quote."
    if flagged:
        text += (
            f" {flagged} of {len(rows)} rows ran one round whose timed calls differ by more than "
            f"{UNRELIABLE_SPREAD:g}x (a busy or shared machine); their ratios to the peer are flagged too."
            " Rerun with --rounds 5 on an idle machine before quoting them."
        )
    if over:
        text += f" {over} rows exceed the measured ceiling, so that ceiling measurement was low."
    return textwrap.wrap(text, WIDTH)


def problems_with_issues(rows: list[Row]) -> list[str]:
    """One line per row that is wrong, failed, or was skipped, with its note."""
    return [
        f"{r.status.upper()}: {r.backend} on {r.case} {r.splits} {r.op} {_recipe_cell(r)}: {r.note}"
        for r in rows
        if r.status != "ok"
    ]


def ineligible_summary(ineligible: list[dict[str, Any]]) -> list[str]:
    """Per backend: on how many problems it was not eligible, and each distinct reason once."""
    by_backend: dict[str, dict[str, int]] = {}
    problems: dict[str, int] = {}
    for item in ineligible:
        problems[item["backend"]] = problems.get(item["backend"], 0) + 1
        reasons = by_backend.setdefault(item["backend"], {})
        # A problem's reasons arrive joined with "; "; messages contain "; " too, codes do not.
        for reason in re.split(r"; (?=\[)", item["reasons"]):
            reasons[reason] = reasons.get(reason, 0) + 1
    lines = []
    for name, reasons in sorted(by_backend.items()):
        lines.append(f"{name}: not eligible for {problems[name]} problem(s):")
        for reason, count in reasons.items():
            lines += textwrap.wrap(f"{reason} ({count})", WIDTH, initial_indent="  ", subsequent_indent="    ")
    return lines


def header(environment: dict[str, Any], ceilings: Ceilings, opts: BenchOptions) -> str:
    """What ran where: device, versions, commit, ceilings and the timing method."""
    dev = environment["device"]
    git = environment["git"]
    commit = (git["commit"] or "unknown")[:12] + (" (uncommitted changes)" if git.get("dirty") else "")
    where = dev["name"]
    if dev["type"] == "cuda":
        where += (
            f" [{dev['arch']}, {dev['multiprocessors']} SMs, driver {dev['driver'] or '?'}, CUDA {dev['cuda_runtime']}]"
        )
    lines = [
        f"device: {where}",
        f"software: torch {environment['torch']}, triton {environment['triton']}, grouped_gemm "
        f"{environment['grouped_gemm']} at {commit}; {environment['date']}",
        "ceilings: " + ceilings_line(ceilings, cpu=dev["type"] != "cuda"),
        f"timing: {timing_line(opts)}",
    ]
    return "\n".join(lines)


def ceilings_line(ceilings: Ceilings, *, cpu: bool = False) -> str:
    size = ceilings.sizes.get("matmul")
    parts = [
        f"{kind} matmul {_sig(v)} TFLOP/s" + (" (emulated by torch on the CPU)" if cpu and kind == "fp8" else "")
        for kind, v in sorted(ceilings.matmul_tflops.items())
    ]
    parts += [f"{kind} {why}" for kind, why in sorted(ceilings.notes.items())]
    copy = f"copy {_sig(ceilings.copy_gbs)} GB/s (read + write)" if ceilings.copy_gbs else "copy not measured"
    line = ", ".join(parts + [copy]) + f" (matmul {size}^3)"
    return line + ("; on a CPU, one short measurement: for orientation only" if cpu else "")


def timing_line(opts: BenchOptions) -> str:
    p = opts.plan
    clock = "CUDA events" if opts.device.type == "cuda" else "time.perf_counter (CPU smoke run)"
    blocks = f", in {p.rounds} blocks taken in turn with the other backends" if p.rounds > 1 else ""
    return (
        f"{clock} around each call, median of ~{p.rep_ms:g} ms of calls ({p.min_reps}..{p.max_reps}) per backend"
        f"{blocks}; ~{p.warmup_ms:g} ms of warm-up first; inputs rotated to exceed 3x L2; random normal data"
    )


def markdown(rows: list[Row], environment: dict[str, Any], ceilings: Ceilings) -> str:
    """A Markdown table for docs/performance.md: one line per problem, the peer and every
    backend side by side as ``TFLOP/s (x peer)``."""
    backends = sorted({r.backend for r in rows if r.role == "backend" and r.status != "skipped"})
    peer_name = next((r.backend for r in rows if r.role == "peer"), None)
    columns = ([peer_name] if peer_name else []) + backends
    git = environment["git"]
    dev = environment["device"]
    lines = [
        f"Command: `{environment['command']}`  ",
        f"Date: {environment['date']}; device {dev['name']}"
        + (f", driver {dev.get('driver')}" if dev["type"] == "cuda" else "")
        + f"; torch {environment['torch']}, triton {environment['triton']}; commit {(git['commit'] or '?')[:12]}"
        + (" (uncommitted changes)" if git.get("dirty") else "")
        + "  ",
        f"Ceilings: {ceilings_line(ceilings, cpu=dev['type'] != 'cuda')}",
        "",
        "| case | G | M | N | K | splits | op | recipe | " + " | ".join(columns) + " |",
        "|" + "---|" * (8 + len(columns)),
    ]
    problems: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        problems.setdefault(_problem_key(r), {})[r.backend] = r
    for key, by_backend in problems.items():
        any_row = next(iter(by_backend.values()))
        cells = [_md_cell(by_backend.get(name)) for name in columns]
        dims = [any_row.case, any_row.groups, any_row.m, any_row.n, any_row.k, *key[1:]]
        lines.append("| " + " | ".join(str(d) for d in dims) + " | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _md_cell(r: Row | None) -> str:
    if r is None or r.status == "skipped":
        return "n/a"
    if r.status == "error":
        return "error"
    if r.status == "wrong":
        return f"WRONG ({_num(r.sqnr_db)} dB)"
    ratio = f" ({r.vs_peer:.2f}x)" if r.vs_peer is not None and r.role == "backend" else ""
    return f"{_sig(r.tflops)}{ratio}"
