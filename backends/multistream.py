"""Backend ``multistream``: one vendor-BLAS GEMM per group, round-robin over N streams.

The portable form of the multi-stream hipBLASLt path of the ROCm stack: every non-empty
group is one torch GEMM (hipBLASLt on ROCm, cuBLASLt / cuBLAS on CUDA) written straight
into its slice of one preallocated output. Groups are dealt round-robin to N side streams
(``GROUPED_GEMM_MULTISTREAM_STREAMS``, default 4, or ``set_streams``) that wait on an
event of the caller's stream and are joined back into it before returning; the operands
are marked as used on every side stream (``record_stream``) so the caching allocator never
hands their memory out while a side stream still reads it.

wgrad accumulation is the GEMM's own ``beta = 1`` (``addmm`` in place, no temporary),
also into an fp32 buffer from bf16 / fp16 operands (torch's ``out_dtype`` overloads,
cuBLAS computing in fp32 and writing fp32). Needs the splits on the host: device splits
cost one device-to-host sync, and the backend cannot run under CUDA-graph capture.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import torch

from grouped_gemm import Backend, BackendSpec, GroupedInputs, Problem, Reason, __version__, hookimpl
from grouped_gemm.errors import ConfigError

ENV_STREAMS = "GROUPED_GEMM_MULTISTREAM_STREAMS"
DEFAULT_STREAMS = 4
#: More side streams than this only adds launch overhead (and CUDA has few hardware queues).
MAX_STREAMS = 32

#: torch's mm/addmm ``out_dtype`` overloads (cuBLAS fp32 output from half inputs; in 2.11, 2.13).
_HAS_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype_out") and hasattr(torch.ops.aten.addmm, "dtype_out")

#: Below ``torch_grouped_mm`` (50) for every problem: on sm_90 (benchmarks/blas_priority.py,
#: docs/backends.md) a loop is ahead only for few large groups, by 1-7 % on average over
#: balanced and skewed splits (within one run's spread); the grouped kernel by up to 17x.
PRIORITY = 20


def parse_streams(value: object, source: str) -> int:
    """A stream count from code or the environment; ConfigError naming ``source`` if bad."""
    try:
        count = int(str(value).strip()) if not isinstance(value, bool) else None
    except ValueError:
        count = None
    if count is None or not 1 <= count <= MAX_STREAMS:
        raise ConfigError(source, value, f"an integer number of streams from 1 to {MAX_STREAMS}")
    return count


def streams_from_env() -> int:
    """``GROUPED_GEMM_MULTISTREAM_STREAMS`` if set (and valid), else the default."""
    raw = os.environ.get(ENV_STREAMS)
    if raw is None or not raw.strip():
        return DEFAULT_STREAMS
    return parse_streams(raw, ENV_STREAMS)


class _StreamPool:
    """Side streams per device, created on first use and reused for the process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[int, list[torch.cuda.Stream]] = {}

    def get(self, device: torch.device, count: int) -> list[torch.cuda.Stream]:
        index = device.index if device.index is not None else torch.cuda.current_device()
        streams = self._streams.get(index, [])
        if len(streams) < count:
            with self._lock:
                streams = self._streams.get(index, [])
                streams = streams + [torch.cuda.Stream(device=index) for _ in range(count - len(streams))]
                self._streams[index] = streams
        return streams[:count]


_POOL = _StreamPool()


class MultistreamBackend(Backend):
    """Per-group torch GEMMs fanned out over side streams; host splits."""

    spec = BackendSpec(
        name="multistream",
        version=__version__,
        description="one cuBLAS/hipBLASLt GEMM per group, round-robin over N streams; "
        "host splits (device splits cost one sync, not capturable)",
        ops=frozenset({"fwd", "dgrad", "wgrad"}),
        recipes=frozenset({"bf16", "fp16", "fp32"}),
        vendors=frozenset({"cuda", "rocm"}),
        host_splits=True,
        accumulate=True,
        weight_list=True,
        non_contiguous=True,
        deterministic=True,
        priority=PRIORITY,
    )

    def __init__(self, streams: int | None = None) -> None:
        self._streams = streams_from_env() if streams is None else parse_streams(streams, "streams")

    @property
    def streams(self) -> int:
        """Side streams the groups are dealt over (1: everything on the caller's stream)."""
        return self._streams

    @streams.setter
    def streams(self, value: int) -> None:
        self._streams = parse_streams(value, "streams")

    def check(self, problem: Problem) -> list[Reason]:
        reasons: list[Reason] = []
        fmt, out = problem.a_format, problem.out_dtype
        half_to_fp32 = out == "float32" and fmt in ("bfloat16", "float16")
        if out != fmt and not half_to_fp32:
            reasons.append(
                Reason("dtype", f"out dtype {out} from {fmt} operands; supports {fmt}, or float32 from bf16/fp16")
            )
        elif half_to_fp32 and not _HAS_OUT_DTYPE:
            reasons.append(Reason("missing", f"torch {torch.__version__} has no mm/addmm out_dtype overloads"))
        if problem.capturing and not problem.host_splits:
            reasons.append(
                Reason("capture", "m_splits are on the device: reading them is a host sync, which capture forbids")
            )
        return reasons

    def run(self, problem: Problem, inputs: GroupedInputs) -> torch.Tensor | list[torch.Tensor]:
        splits = inputs.splits_list()
        a = inputs.a
        out = inputs.output(problem)
        gemm = _gemm_for(problem, inputs, out)
        jobs: list[tuple[int, int, int]] = []
        start = 0
        for g, rows in enumerate(splits):
            if rows:
                jobs.append((g, start, rows))
            elif problem.op == "wgrad" and not problem.accumulate:
                out[g].zero_()
            start += rows
        count = min(self._streams, len(jobs))
        if count <= 1:
            for job in jobs:
                gemm(*job)
            return out
        _fan_out(jobs, gemm, count, a.device, _operands(inputs, out))
        return out


def _operands(inputs: GroupedInputs, out: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    """Every tensor a side stream reads or writes."""
    tensors = [inputs.a]
    for item in (inputs.b, out):
        tensors.extend(item if isinstance(item, list) else [item])
    return tensors


def _fan_out(
    jobs: list[tuple[int, int, int]],
    gemm: Callable[[int, int, int], None],
    count: int,
    device: torch.device,
    operands: list[torch.Tensor],
) -> None:
    """Run ``jobs`` round-robin on ``count`` side streams, fenced by the caller's stream."""
    with torch.cuda.device(device):
        caller = torch.cuda.current_stream()
        ready = caller.record_event()
        for i, stream in enumerate(_POOL.get(device, count)):
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                for job in jobs[i::count]:
                    gemm(*job)
            for t in operands:
                t.record_stream(stream)
            caller.wait_event(stream.record_event())


def _gemm_for(problem: Problem, inputs: GroupedInputs, out: torch.Tensor | list[torch.Tensor]) -> Callable:
    """The per-group GEMM ``(group, first_row, rows) -> None`` for an op, writing into ``out``."""
    a, b = inputs.a, inputs.b
    fp32_out = problem.out_dtype == "float32" and problem.a_format != "float32"
    if problem.op == "wgrad":
        beta = 1 if problem.accumulate else 0

        def wgrad(g: int, start: int, rows: int) -> None:
            target = out[g]
            dy_g, x_g = a[start : start + rows].t(), b[start : start + rows]
            if fp32_out:
                torch.ops.aten.addmm.dtype_out(target, dy_g, x_g, torch.float32, beta=beta, alpha=1, out=target)
            elif beta:
                torch.addmm(target, dy_g, x_g, beta=1, out=target)
            else:
                torch.mm(dy_g, x_g, out=target)

        return wgrad
    transpose = problem.op == "fwd"

    def fwd_or_dgrad(g: int, start: int, rows: int) -> None:
        w_g = b[g].t() if transpose else b[g]
        target = out[start : start + rows]
        if fp32_out:
            torch.ops.aten.mm.dtype_out(a[start : start + rows], w_g, torch.float32, out=target)
        else:
            torch.mm(a[start : start + rows], w_g, out=target)

    return fwd_or_dgrad


_BACKEND = MultistreamBackend()


def set_streams(count: int) -> None:
    """Set the number of side streams of the registered ``multistream`` backend (1..32)."""
    _BACKEND.streams = count


@hookimpl
def grouped_gemm_backends() -> list[Backend]:
    return [_BACKEND]
