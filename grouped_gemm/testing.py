"""Numerics shared by tests, ``grouped-gemm check`` and the benchmarks.

Float64 ground truth for each op, error measures and the SQNR floors a correct result
must reach, poisoned outputs, and random problem data that is never zeros (zeros hide
unwritten outputs and wrong indexing).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from grouped_gemm.recipes import get_recipe

#: A value no correct kernel writes; ``poison`` fills outputs with it before a run.
POISON = float("nan")


#: Elements per float64 chunk of ``sqnr_db`` (a whole wgrad result of a large MoE layer, in
#: float64 twice over, would not fit on the GPU beside its operands).
_SQNR_CHUNK = 1 << 24


def sqnr_db(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``10 log10(|ref|^2 / |out - ref|^2)``.

    NaN or Inf anywhere in ``actual`` gives ``-inf``; an exact match gives ``inf``.
    """
    if actual.shape != expected.shape:
        raise ValueError(f"sqnr_db: actual {tuple(actual.shape)} and expected {tuple(expected.shape)} differ in shape")
    a = actual.detach().reshape(-1)
    e = expected.detach().reshape(-1)
    noise = signal = 0.0
    for i in range(0, a.numel(), _SQNR_CHUNK):
        ac = a[i : i + _SQNR_CHUNK].to(torch.float64)
        ec = e[i : i + _SQNR_CHUNK].to(torch.float64)
        if not torch.isfinite(ac).all():
            return -math.inf
        noise += torch.sum((ac - ec) ** 2).item()
        signal += torch.sum(ec**2).item()
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


# --- What "correct" means (docs/mx_formats.md has the recipes' measured errors) -------
# Same function (identical inputs, only accumulation order differs), fp32 output: 60 dB.
# A bf16 / fp16 output is the exact result rounded to nearest with p significand bits
# (8 / 11), a relative error of at most 2^-p per element, so rounding alone can bring the
# SQNR down to 20 p log10(2): 48.2 dB for bf16, 66.2 dB for fp16. The floor is that bound
# less 3 dB of accumulation-order noise, capped at 60 dB: bf16 45.2 dB, fp16 60 dB, fp32
# 60 dB.
SAME_FUNCTION_DB = 60.0
ROUNDING_MARGIN_DB = 3.0
_SIGNIFICAND_BITS = {"bfloat16": 8, "float16": 11, "float32": 24}
#: A recipe against the unquantized float64 result on random normal data: MXFP8 25 dB,
#: any recipe with e2m1 weights 12 dB.
RECIPE_VS_UNQUANTIZED_DB = {"mxfp8": 25.0, "mxfp4": 12.0, "a8w4": 12.0, "a16w4": 12.0}


def output_floor_db(out_dtype: str) -> float:
    """The same-function floor for an output dtype (see the rules above)."""
    bits = _SIGNIFICAND_BITS[out_dtype]
    return min(SAME_FUNCTION_DB, 20.0 * bits * math.log10(2.0) - ROUNDING_MARGIN_DB)


def sqnr_floor(out_dtype: str, recipe: str, same_function: bool) -> float:
    """The SQNR a correct result must reach: the output floor for the same function, else
    (an MX recipe against unquantized inputs) the recipe's floor."""
    floor = output_floor_db(out_dtype)
    if same_function:
        return floor
    return min(floor, RECIPE_VS_UNQUANTIZED_DB.get(recipe, floor))


def same_function(recipe: str, op: str, prequantized_weight: bool) -> bool:
    """Whether a float64 product of the operands as passed computes what the backend does
    under ``recipe``: true unless the backend still quantizes an operand (plain recipes;
    MX weights passed pre-quantized with the other operand in a format the recipe keeps
    high-precision)."""
    r = get_recipe(recipe)
    if not r.is_mx:
        return True
    if op == "wgrad":
        return r.grad_format is None and r.act_format is None
    return prequantized_weight and (r.act_format if op == "fwd" else r.grad_format) is None


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (inf for NaN/Inf outputs)."""
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    if not torch.isfinite(a).all():
        return math.inf
    denom = torch.linalg.vector_norm(e).item()
    diff = torch.linalg.vector_norm(a - e).item()
    return diff if denom == 0.0 else diff / denom


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with NaN in place (so a row a kernel forgot shows up) and return it."""
    return t.fill_(POISON)


def _groups(w: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return list(w) if not isinstance(w, torch.Tensor) else list(w.unbind(0))


def ref_fwd(x: torch.Tensor, w: torch.Tensor | Sequence[torch.Tensor], splits: Sequence[int]) -> torch.Tensor:
    """Float64 ``out_g = x_g @ w_g^T``."""
    ws = _groups(w)
    out = torch.zeros(x.shape[0], ws[0].shape[0], dtype=torch.float64, device=x.device)
    start = 0
    for g, rows in enumerate(splits):
        out[start : start + rows] = x[start : start + rows].double() @ ws[g].double().T
        start += rows
    return out


def ref_dgrad(dy: torch.Tensor, w: torch.Tensor | Sequence[torch.Tensor], splits: Sequence[int]) -> torch.Tensor:
    """Float64 ``dx_g = dy_g @ w_g``."""
    ws = _groups(w)
    out = torch.zeros(dy.shape[0], ws[0].shape[1], dtype=torch.float64, device=dy.device)
    start = 0
    for g, rows in enumerate(splits):
        out[start : start + rows] = dy[start : start + rows].double() @ ws[g].double()
        start += rows
    return out


def ref_wgrad(dy: torch.Tensor, x: torch.Tensor, splits: Sequence[int]) -> torch.Tensor:
    """Float64 ``dw_g = dy_g^T @ x_g`` (zeros for empty groups)."""
    out = torch.zeros(len(splits), dy.shape[1], x.shape[1], dtype=torch.float64, device=dy.device)
    start = 0
    for g, rows in enumerate(splits):
        out[g] = dy[start : start + rows].double().T @ x[start : start + rows].double()
        start += rows
    return out


def random_splits(groups: int, m: int, *, empty: int = 0, generator: torch.Generator | None = None) -> list[int]:
    """Random non-negative sizes summing to ``m`` with at least ``empty`` zero groups."""
    if empty >= groups and m:
        raise ValueError(f"cannot place m={m} rows with all {groups} groups empty")
    # On the generator's device (the CPU without one), not torch's default device, where a
    # GPU or meta default failed inside torch.
    device = generator.device if generator is not None else "cpu"
    weights = torch.rand(groups, generator=generator, dtype=torch.float64, device=device) ** 2 + 1e-3
    weights[torch.randperm(groups, generator=generator, device=device)[:empty]] = 0.0
    sizes = torch.floor(weights / weights.sum() * m).to(torch.int64)
    live = torch.nonzero(weights).flatten()
    sizes[live[0]] += m - int(sizes.sum())
    return [int(s) for s in sizes.tolist()]
