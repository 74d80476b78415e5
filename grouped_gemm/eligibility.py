"""Turn a backend's declared spec into reasons, the same words for every backend."""

from __future__ import annotations

import fnmatch

from grouped_gemm.contract import BackendSpec, Reason
from grouped_gemm.problem import Problem


def _listing(values: object) -> str:
    return ", ".join(sorted(str(v) for v in values)) or "none"


def _format_reason(fmt: str, operand: str, spec: BackendSpec) -> Reason | None:
    if fmt.startswith("mx_"):
        if fmt[3:] not in spec.mx_formats:
            return Reason(
                "dtype",
                f"{operand} is a pre-quantized MX {fmt[3:]} tensor; accepted MX formats: {_listing(spec.mx_formats)}",
            )
    elif fmt not in spec.dtypes:
        return Reason("dtype", f"{operand} dtype {fmt} not supported; supports {_listing(spec.dtypes)}")
    return None


def declared_reasons(spec: BackendSpec, problem: Problem) -> list[Reason]:
    """Every way ``problem`` falls outside what ``spec`` declares (empty: within it)."""
    reasons: list[Reason] = []
    add = reasons.append
    if problem.op not in spec.ops:
        add(Reason("op", f"op {problem.op} not supported; supports {_listing(spec.ops)}"))
    if problem.recipe not in spec.recipes:
        add(Reason("recipe", f"recipe {problem.recipe} not supported; supports {_listing(spec.recipes)}"))
    device = problem.device
    if device.vendor not in spec.vendors:
        add(Reason("vendor", f"device vendor {device.vendor} not supported; supports {_listing(spec.vendors)}"))
    elif spec.archs and not any(fnmatch.fnmatchcase(device.arch, pat) for pat in spec.archs):
        add(Reason("arch", f"arch {device.arch} not supported; supports {_listing(spec.archs)}"))
    wanted = {"cpu"} if problem.placement == "cpu" else {"cuda", "rocm"}
    if not wanted & spec.vendors:
        add(Reason("placement", f"tensors are on {problem.placement}; runs on {_listing(spec.vendors)} devices"))
    for fmt, operand in ((problem.a_format, "a"), (problem.b_format, "b")):
        reason = _format_reason(fmt, operand, spec)
        if reason:
            add(reason)
    if problem.out_dtype not in spec.out_dtypes:
        add(Reason("dtype", f"out dtype {problem.out_dtype} not supported; supports {_listing(spec.out_dtypes)}"))
    for dim, value, multiple in (("N", problem.n, spec.n_multiple), ("K", problem.k, spec.k_multiple)):
        if value % multiple:
            add(Reason("align", f"{dim}={value} is not a multiple of {multiple}"))
    if problem.k < spec.min_k:
        add(Reason("shape", f"K={problem.k} is below the minimum {spec.min_k}"))
    if spec.m_multiple > 1:
        if problem.m_align == 0:
            add(
                Reason(
                    "align",
                    f"needs every group's rows to be a multiple of {spec.m_multiple}; "
                    "m_splits are on the device and are not read",
                )
            )
        elif problem.m_align % spec.m_multiple:
            add(
                Reason(
                    "align",
                    f"needs every group's rows to be a multiple of {spec.m_multiple}; "
                    f"the splits are only multiples of {problem.m_align}",
                )
            )
    if spec.max_groups is not None and problem.groups > spec.max_groups:
        add(Reason("groups", f"G={problem.groups} exceeds the maximum {spec.max_groups}"))
    if spec.max_padding is not None and problem.max_rows is not None:
        # Judged against M's bucket, as the decision serves every M there: just above a
        # power of two the padding can reach twice the limit, at a power of two (the usual
        # token count) it is exact.
        padded = problem.groups * problem.max_rows
        if padded > spec.max_padding * max(problem.m_bucket, 1):
            add(
                Reason(
                    "shape",
                    f"pads every group to the largest: G={problem.groups} x up to {problem.max_rows} rows = "
                    f"{padded} rows, more than {spec.max_padding:g}x M's bucket ({problem.m_bucket} rows); "
                    "the splits are too uneven",
                )
            )
    if spec.host_splits and problem.capturing:
        add(Reason("capture", "reads m_splits on the host, which cannot happen during CUDA-graph capture"))
    if problem.accumulate and not spec.accumulate:
        add(Reason("accumulate", "cannot accumulate into an existing wgrad buffer"))
    if problem.weight_list and not spec.weight_list:
        add(Reason("layout", "needs one stacked (G, N, K) tensor, got a list of G tensors"))
    if not problem.contiguous and not spec.non_contiguous:
        add(Reason("layout", "needs contiguous operands"))
    return reasons
