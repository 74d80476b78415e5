"""``grouped-gemm check``: every backend that can run here, against the reference, pass/fail.

The first thing to run on a new machine. Each backend runs every op and recipe it is
eligible for on small random problems (skewed splits, empty groups, all groups empty,
one group, unaligned sizes), with the output poisoned with NaN first, and its SQNR
against the expected result is compared with the floors of ``grouped_gemm.testing``. Without a GPU, Triton
kernels run in the Triton interpreter (the command line reruns itself with ``TRITON_INTERPRET=1`` when unset).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import zlib
from collections import Counter
from typing import Any

import torch

import grouped_gemm as gg
from grouped_gemm import testing
from grouped_gemm.errors import InvalidArgumentError
from grouped_gemm.testing import RECIPE_VS_UNQUANTIZED_DB, output_floor_db, same_function, sqnr_floor
from grouped_gemm.tools import Progress, add_device_option, prequantized_weight, torch_device

# --- The problems ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A small problem shape with fixed group sizes."""

    name: str
    n: int
    k: int
    splits: tuple[int, ...]

    @property
    def groups(self) -> int:
        return len(self.splits)

    @property
    def m(self) -> int:
        return sum(self.splits)


#: Small on purpose: under the Triton interpreter (no GPU) each call costs seconds.
SCENARIOS = (
    Scenario("aligned", 128, 128, (64, 64, 64, 64)),
    Scenario("skewed", 64, 128, tuple(gg.skewed_splits(8, 256))),
    Scenario("empty_groups", 96, 96, (0, 50, 0, 35, 65, 0)),
    Scenario("all_empty", 64, 64, (0, 0, 0)),
    Scenario("single_group", 64, 96, (77,)),
    Scenario("unaligned", 40, 24, (33, 0, 68)),
)

#: Op variants: the three ops, wgrad accumulating into an existing fp32 buffer, and fwd /
#: dgrad with the weight passed as an MXTensor (``gg.quantize_mx``; MX recipes only).
VARIANTS = ("fwd", "dgrad", "wgrad", "wgrad+acc", "fwd+mxw", "dgrad+mxw")


@dataclasses.dataclass
class Case:
    """One call to check: inputs, expected result and how it was obtained."""

    scenario: Scenario
    variant: str
    recipe: str
    out_dtype: torch.dtype
    a: torch.Tensor
    b: Any
    b_values: torch.Tensor
    init: torch.Tensor | None
    expected64: torch.Tensor | None = None
    expected_same: torch.Tensor | None = None

    @property
    def op(self) -> str:
        return self.variant.split("+")[0]

    @property
    def accumulate(self) -> bool:
        return self.variant.endswith("+acc")

    @property
    def same_function(self) -> bool:
        """Whether float64 of ``a`` and ``b_values`` is exactly what the backend computes."""
        return same_function(self.recipe, self.op, self.variant.endswith("+mxw"))

    def fresh_out(self) -> torch.Tensor:
        """The output buffer: the initial values when accumulating, else NaN poison."""
        if self.init is not None:
            return self.init.clone()
        sc = self.scenario
        shape = {"fwd": (sc.m, sc.n), "dgrad": (sc.m, sc.k)}.get(self.op, (sc.groups, sc.n, sc.k))
        return testing.poison(torch.empty(shape, dtype=self.out_dtype, device=self.a.device))

    def call(self, backend: Any) -> torch.Tensor:
        """Run through the public API with ``backend=`` (dispatch included)."""
        splits = list(self.scenario.splits)
        out = self.fresh_out()
        if self.op == "wgrad":
            return gg.grouped_gemm_wgrad(
                self.a, self.b, splits, recipe=self.recipe, out=out, accumulate=self.accumulate, backend=backend
            )
        fn = gg.grouped_gemm if self.op == "fwd" else gg.grouped_gemm_dgrad
        return fn(self.a, self.b, splits, recipe=self.recipe, out=out, backend=backend)

    def explain(self) -> gg.Decision:
        return gg.explain(
            self.a,
            self.b,
            list(self.scenario.splits),
            op=self.op,
            recipe=self.recipe,
            out=self.fresh_out(),
            accumulate=self.accumulate,
        )


def _input_dtype(recipe: str) -> torch.dtype:
    plain = gg.get_recipe(recipe).plain_dtype
    return {"float16": torch.float16, "float32": torch.float32}.get(plain or "", torch.bfloat16)


def _float64_expected(case: Case) -> torch.Tensor:
    splits = list(case.scenario.splits)
    if case.op == "fwd":
        return testing.ref_fwd(case.a, case.b_values, splits)
    if case.op == "dgrad":
        return testing.ref_dgrad(case.a, case.b_values, splits)
    expected = testing.ref_wgrad(case.a, case.b_values, splits)
    return expected + case.init.double() if case.init is not None else expected


def _make_case(scenario: Scenario, variant: str, recipe: str, out_dtype: torch.dtype, device: torch.device) -> Case:
    seed = zlib.crc32(f"{scenario.name}/{variant}/{recipe}".encode())
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = _input_dtype(recipe)
    op = variant.split("+")[0]
    m, n, k, g = scenario.m, scenario.n, scenario.k, scenario.groups

    def rand(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device) * std).to(dtype)

    if op == "wgrad":
        a, b = rand(m, n), rand(m, k)
    else:
        a, b = rand(m, k if op == "fwd" else n), rand(g, n, k, std=k**-0.5)
    init = None
    if variant.endswith("+acc"):
        init = torch.randn((g, n, k), generator=gen, device=device, dtype=torch.float32).to(out_dtype)
    if variant.endswith("+mxw"):
        q = prequantized_weight(b, recipe, op)
        return Case(scenario, variant, recipe, out_dtype, a, q, q.dequantize(), init)
    return Case(scenario, variant, recipe, out_dtype, a, b, b, init)


def _out_dtypes(recipe: str) -> list[torch.dtype]:
    first = _input_dtype(recipe)
    return [first] if first == torch.float32 else [first, torch.float32]


# --- Running --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Result:
    """One backend on one case."""

    backend: str
    scenario: str
    variant: str
    recipe: str
    out_dtype: str
    status: str  # pass, FAIL, ERROR, skip
    sqnr_db: float | None = None
    floor_db: float | None = None
    reference: str = ""
    message: str = ""


def _no_mx_weight(scenario: Scenario, op: str, recipe: str) -> bool:
    """True when the weight cannot be pre-quantized: a plain recipe, high-precision weights,
    or a block axis (K for fwd, N for dgrad) not a multiple of the block size."""
    axis_length = scenario.k if op == "fwd" else scenario.n
    r = gg.get_recipe(recipe)
    return r.weight_format is None or axis_length % r.block_size != 0


def _specs(recipes: list[str], variants: list[str]) -> list[tuple[Scenario, str, str, torch.dtype]]:
    """Every (scenario, op variant, recipe, out dtype) to check."""
    specs = []
    for scenario in SCENARIOS:
        for recipe in recipes:
            for variant in variants:
                if variant.endswith("+mxw") and _no_mx_weight(scenario, variant.split("+")[0], recipe):
                    continue
                for out_dtype in _out_dtypes(recipe):
                    if variant.endswith("+acc") and out_dtype != torch.float32:
                        continue  # accumulation targets an fp32 main_grad buffer
                    specs.append((scenario, variant, recipe, out_dtype))
    return specs


def _set_expected(case: Case, decision: gg.Decision) -> None:
    """Float64 of the inputs as given, and for MX recipes also the reference backend's
    fp32 result on the same inputs (the same function) when it is eligible."""
    case.expected64 = _float64_expected(case)
    if not case.same_function and _eligible(decision, "reference"):
        fp32 = dataclasses.replace(case, out_dtype=torch.float32)
        case.expected_same = fp32.call("reference").double()


def _expected_for(name: str, case: Case) -> tuple[torch.Tensor, str, bool]:
    """(expected, what it is, same function?) for a backend on a case."""
    if case.same_function:
        return case.expected64, "float64", True
    if case.expected_same is not None and name != "reference":
        return case.expected_same, "reference backend, fp32 out", True
    return case.expected64, "float64 of unquantized inputs", False


def _eligible(decision: gg.Decision, name: str) -> bool:
    return any(c.name == name and c.eligible for c in decision.candidates)


def run_checks(
    backends: list[str], recipes: list[str], variants: list[str], device: torch.device, progress: bool = False
) -> list[Result]:
    """Every (backend, case) pair: pass / FAIL / ERROR, or skip with the backend's reasons."""
    results = []
    specs = _specs(recipes, variants)
    bar = Progress(len(specs), enabled=progress)
    with gg.use_backends(strict=True, debug=True):  # debug: a backend modifying its inputs fails
        for scenario, variant, recipe, out_dtype in specs:
            bar.step(f"{scenario.name} {variant} {recipe} out={str(out_dtype).removeprefix('torch.')}")
            case = _make_case(scenario, variant, recipe, out_dtype, device)
            decision = case.explain()
            by_name = {c.name: c for c in decision.candidates}
            odt = str(case.out_dtype).removeprefix("torch.")
            base = dict(scenario=case.scenario.name, variant=case.variant, recipe=case.recipe, out_dtype=odt)
            if any(by_name[name].eligible for name in backends):
                _set_expected(case, decision)
            for name in backends:
                candidate = by_name[name]
                if not candidate.eligible:
                    reasons = "; ".join(str(r) for r in candidate.reasons)
                    results.append(Result(name, status="skip", message=reasons, **base))
                    continue
                results.append(_check_one(name, case, base))
    bar.close()
    return results


def _check_one(name: str, case: Case, base: dict[str, str]) -> Result:
    expected, reference, same = _expected_for(name, case)
    floor = sqnr_floor(base["out_dtype"], case.recipe, same_function=same)
    context = dict(floor_db=floor, reference=reference, **base)
    try:
        out = case.call(name)
    except gg.GroupedGemmError as exc:
        return Result(name, status="ERROR", message=str(exc), **context)
    if not isinstance(out, torch.Tensor) or out.dtype != case.out_dtype or out.shape != expected.shape:
        got = f"{type(out).__name__} {getattr(out, 'dtype', '')} {tuple(getattr(out, 'shape', ()))}"
        return Result(
            name, status="FAIL", message=f"returned {got}, expected {case.out_dtype} {tuple(expected.shape)}", **context
        )
    sqnr = testing.sqnr_db(out, expected)
    return Result(name, status="pass" if sqnr >= floor else "FAIL", sqnr_db=sqnr, **context)


# --- Reporting and the command ----------------------------------------------------------


def _fmt_db(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if math.isfinite(value) else ("exact" if value > 0 else "-inf")


def summary_rows(results: list[Result]) -> list[tuple[str, ...]]:
    """One row per (backend, op variant, recipe, out dtype) that ran: runs, worst SQNR, floor, result."""
    groups: dict[tuple[str, str, str, str], list[Result]] = {}
    for r in results:
        if r.status != "skip":
            groups.setdefault((r.backend, r.variant, r.recipe, r.out_dtype), []).append(r)
    rows = [("backend", "op", "recipe", "out", "runs", "min SQNR dB", "floor dB", "result")]
    for (backend, variant, recipe, odt), runs in sorted(groups.items(), key=lambda item: item[0][0]):
        measured = [r.sqnr_db for r in runs if r.sqnr_db is not None]
        bad = sum(r.status != "pass" for r in runs)
        rows.append(
            (
                backend,
                variant,
                recipe,
                odt,
                str(len(runs)),
                _fmt_db(min(measured)) if measured else "-",
                _fmt_db(min(r.floor_db for r in runs if r.floor_db is not None)),
                "pass" if not bad else f"FAIL ({bad})",
            )
        )
    return rows


def format_table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def _floors_line() -> str:
    outs = ", ".join(f"{d} {output_floor_db(d):.1f}" for d in ("float32", "float16", "bfloat16"))
    mx = ", ".join(f"{r} {v:.0f}" for r, v in RECIPE_VS_UNQUANTIZED_DB.items())
    return f"SQNR floors (dB): same function, by output dtype: {outs}; MX recipe vs unquantized inputs: {mx}"


def _main_reason(results: list[Result], backend: str) -> str:
    """The most frequent skip reason of a backend, preferring ones not about op or recipe."""
    counts = Counter(r.message for r in results if r.backend == backend)
    if not counts:
        return "no problem was tried"
    telling = [m for m in counts if "[recipe]" not in m and "[op]" not in m] or list(counts)
    return max(telling, key=lambda m: counts[m])


def report(results: list[Result], backends: list[str], verbose: bool) -> str:
    """The text ``grouped-gemm check`` prints, ending with its verdict line."""
    lines = [_floors_line(), ""]
    ran = {r.backend for r in results if r.status != "skip"}
    rows = summary_rows(results)
    if len(rows) > 1:
        lines.append(format_table(rows))
    for name in backends:
        if name not in ran:
            lines.append(f"{name}: not runnable on any check problem here: {_main_reason(results, name)}")
    bad = [r for r in results if r.status in ("FAIL", "ERROR")]
    shown = results if verbose else bad
    if shown:
        lines.append("\ndetails:" if verbose else "\nfailures:")
        for r in shown:
            sqnr = "" if r.sqnr_db is None else f"SQNR {_fmt_db(r.sqnr_db)} dB (floor {_fmt_db(r.floor_db)})"
            where = f"{r.backend} {r.variant} {r.recipe} {r.scenario} out={r.out_dtype}"
            against = f"vs {r.reference}" if r.reference else ""
            lines.append(f"  {r.status:5} {where} {sqnr} {against} {r.message}".rstrip())
    total = sum(r.status != "skip" for r in results)
    skipped = len(results) - total
    if not total:
        lines.append("\ngrouped-gemm check: FAILED, no backend ran any problem")
    elif bad:
        lines.append(f"\ngrouped-gemm check: FAILED, {len(bad)} of {total} runs ({skipped} not eligible)")
    else:
        lines.append(f"\ngrouped-gemm check: all {total} runs passed ({skipped} not eligible)")
    return "\n".join(lines)


def _names(value: str | None, argument: str, allowed: tuple[str, ...]) -> list[str]:
    if value is None:
        return list(allowed)
    # Once each, in order: a name given twice was checked twice and counted twice in the summary.
    names = list(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))
    for name in names:
        if name not in allowed:
            raise InvalidArgumentError(argument, name, f"one of {', '.join(allowed)}")
    if not names:
        raise InvalidArgumentError(argument, value, f"a comma-separated list of {', '.join(allowed)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backends", help="comma-separated backends to check (default: every registered one)")
    parser.add_argument("--recipes", help=f"comma-separated recipes (default: all of {', '.join(gg.RECIPES)})")
    parser.add_argument("--ops", help=f"comma-separated op variants (default: all of {', '.join(VARIANTS)})")
    add_device_option(parser)
    parser.add_argument("--verbose", "-v", action="store_true", help="print every run, and why backends were skipped")
    parser.add_argument("--quiet", action="store_true", help="no progress line on stderr")


def run_command(args: argparse.Namespace) -> int:
    """``grouped-gemm check``: 0 when every run passed, 1 on any failure."""
    device = torch_device(args.device)
    registered = [b.name for b in gg.list_backends()]
    backends = _names(args.backends, "backends", tuple(registered))
    recipes = _names(args.recipes, "recipes", tuple(gg.RECIPES))
    variants = _names(args.ops, "ops", VARIANTS)
    import triton

    here = gg.describe_problem(groups=1, m=1, n=1, k=1).device if device.type == "cuda" else "cpu"
    interp = f", TRITON_INTERPRET={os.environ['TRITON_INTERPRET']}" if "TRITON_INTERPRET" in os.environ else ""
    print(f"grouped-gemm check on {here}: torch {torch.__version__}, triton {triton.__version__}{interp}")
    results = run_checks(backends, recipes, variants, device, progress=not args.quiet)
    text = report(results, backends, args.verbose)
    print(text)
    sys.stdout.flush()
    return 1 if "FAILED" in text.splitlines()[-1] else 0
