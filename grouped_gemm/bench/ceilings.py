"""The machine's ceilings, measured once at the start of a run.

A dense square matmul per input dtype (bf16/fp16/fp32 through ``torch.mm``; fp8 e4m3
through ``torch._scaled_mm`` with unit scales) and a device-to-device copy (bytes read
plus bytes written). Random normal data: zeros run measurably faster on tensor cores.
"""

from __future__ import annotations

import dataclasses

import torch

from grouped_gemm.bench.timing import TimingPlan, median, time_calls
from grouped_gemm.recipes import get_recipe

#: Square matmul size and copy size on a GPU and on the CPU (the CPU only for smoke runs).
_GPU_MATMUL, _CPU_MATMUL = 8192, 384
_GPU_COPY_BYTES, _CPU_COPY_BYTES = 1 << 30, 32 << 20

_PLAN = TimingPlan(warmup_ms=50.0, rep_ms=200.0, min_reps=5, max_reps=100)
_HOST_PLAN = TimingPlan(warmup_ms=5.0, rep_ms=20.0, min_reps=3, max_reps=20)


def matmul_kind(recipe: str) -> str:
    """Which matmul ceiling bounds a recipe on today's chips.

    MX recipes with 8-bit or 4-bit activations are bounded by the fp8 rate (no chip we
    target multiplies e2m1 faster than e4m3 except through scaled MMA, which Hopper
    lacks); a16w4 multiplies bf16 activations, so bf16 bounds it.
    """
    resolved = get_recipe(recipe)
    if resolved.plain_dtype is not None:
        return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[resolved.plain_dtype]
    return "fp8" if resolved.act_format is not None else "bf16"


@dataclasses.dataclass
class Ceilings:
    """Measured TFLOP/s per matmul kind, copy GB/s, and why any is missing."""

    matmul_tflops: dict[str, float] = dataclasses.field(default_factory=dict)
    copy_gbs: float | None = None
    notes: dict[str, str] = dataclasses.field(default_factory=dict)
    sizes: dict[str, int] = dataclasses.field(default_factory=dict)


def _matmul_fn(kind: str, size: int, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(0)
    if kind == "fp8":
        a = torch.randn(size, size, device=device, generator=gen).to(torch.float8_e4m3fn)
        b = torch.randn(size, size, device=device, generator=gen).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        return lambda _i: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[kind]
    a = torch.randn(size, size, dtype=dtype, device=device, generator=gen)
    b = torch.randn(size, size, dtype=dtype, device=device, generator=gen)
    return lambda _i: torch.mm(a, b)


def measure(kinds: set[str], device: torch.device) -> Ceilings:
    """Ceilings for the matmul ``kinds`` needed and the copy bandwidth on ``device``."""
    gpu = device.type == "cuda"
    plan = _PLAN if gpu else _HOST_PLAN
    size = _GPU_MATMUL if gpu else _CPU_MATMUL
    out = Ceilings(sizes={"matmul": size, "copy_bytes": _GPU_COPY_BYTES if gpu else _CPU_COPY_BYTES})
    for kind in sorted(kinds):
        try:
            ms = median(time_calls(_matmul_fn(kind, size, device), 1, device, plan))
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            out.notes[kind] = f"not measured: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            continue
        out.matmul_tflops[kind] = 2 * size**3 / (ms / 1e3) / 1e12
    copy_bytes = out.sizes["copy_bytes"]
    src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    ms = median(time_calls(lambda _i: dst.copy_(src), 1, device, plan))
    out.copy_gbs = 2 * copy_bytes / (ms / 1e3) / 1e9
    return out
