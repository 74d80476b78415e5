"""What a timing means: TFLOP/s, GB/s, and the share of the measured roofline.

Bytes are the least a call must move: each operand read once as passed (bf16 inputs of
an MX recipe count as bf16; a pre-quantized MX operand as its elements plus one scale
byte per 32), and the result written once.
"""

from __future__ import annotations

import dataclasses

from grouped_gemm.problem import Problem

#: Bytes per element of each operand format ``Problem`` can name. MX formats carry one
#: E8M0 scale byte per block of 32 elements (OCP MX v1.0).
_ELEMENT_BYTES = {
    "bfloat16": 2.0,
    "float16": 2.0,
    "float32": 4.0,
    "mx_e4m3": 1.0 + 1.0 / 32,
    "mx_e5m2": 1.0 + 1.0 / 32,
    "mx_e2m1": 0.5 + 1.0 / 32,
}


def element_bytes(fmt: str) -> float:
    """Bytes per element of a ``Problem`` format name."""
    return _ELEMENT_BYTES[fmt]


def bytes_moved(problem: Problem, live_groups: int | None = None) -> float:
    """Least bytes one call reads and writes (see the module docstring).

    fwd / dgrad read only the weights of the ``live_groups`` groups that have rows
    (default: all G); wgrad writes every group's dw (zeros for empty groups).
    """
    g, m, n, k = problem.groups, problem.m, problem.n, problem.k
    live = g if live_groups is None else live_groups
    a_elems, b_elems, out_elems = {
        "fwd": (m * k, live * n * k, m * n),
        "dgrad": (m * n, live * n * k, m * k),
        "wgrad": (m * n, m * k, g * n * k),
    }[problem.op]
    out_bytes = out_elems * element_bytes(problem.out_dtype) * (2 if problem.accumulate else 1)
    return a_elems * element_bytes(problem.a_format) + b_elems * element_bytes(problem.b_format) + out_bytes


@dataclasses.dataclass(frozen=True)
class Rates:
    """Derived figures of one median time."""

    tflops: float
    gbs: float
    pct_of_ceiling: float | None


def rates(flops: float, nbytes: float, ms: float, matmul_tflops: float | None, copy_gbs: float | None) -> Rates:
    """TFLOP/s, GB/s and the roofline share: the time the ceilings allow
    (``max(flops / matmul rate, bytes / copy bandwidth)``) over the time measured, in %.
    None when a ceiling was not measured."""
    seconds = ms / 1e3
    tflops = flops / seconds / 1e12
    gbs = nbytes / seconds / 1e9
    pct = None
    if matmul_tflops and copy_gbs:
        ideal = max(flops / (matmul_tflops * 1e12), nbytes / (copy_gbs * 1e9))
        pct = 100.0 * ideal / seconds
    return Rates(tflops=tflops, gbs=gbs, pct_of_ceiling=pct)
