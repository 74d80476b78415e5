"""Backend ``torch_grouped_mm``: torch's own grouped GEMM, ``torch._grouped_mm``.

One launch for all groups, group ends read on the device (``GroupedInputs.offsets``): no
host sync, CUDA-graph capturable. What it declares follows torch's own checks
(aten/src/ATen/native/GroupedMMUtils.h, cuda/GroupedBlas.cpp, cuda/GroupMM.cu and
GroupMMCommon.cuh, torch 2.8 .. 2.13; docs/backends.md has the details):

- CUDA runs a CUTLASS kernel only on compute capability 9.x / 10.x with bf16 operands and a
  bf16 result, and fewer than 1024 groups; anything else goes through torch's per-group
  fallback loop, which copies the offsets to the host (a sync, not capturable), so it is
  declared ineligible (``multistream`` does that job better).
- ROCm runs the CK kernel only on gfx942 / gfx950 when ``ROCM_ALLOW_GROUP_GEMM_CK`` is set
  (torch >= 2.10 defaults to the same fallback loop).
- CPU tensors run torch's composite per-group ``mm`` loop (bf16, fp16, fp32).
- The result dtype is the input dtype; strides must be 16-byte multiples (so N and K are
  multiples of 16 bytes of elements) and CUDA base pointers 16-byte aligned.

Operands torch would reject (misaligned views, other layouts) are copied to a row-major
layout first. Empty groups: wgrad groups without rows come out zero on sm_90 and on the
CPU; on sm_100 (pytorch#172439) and ROCm (pytorch#174314) they are cleared here.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

from grouped_gemm import Backend, BackendSpec, GroupedInputs, Problem, Reason, __version__, hookimpl
from grouped_gemm.vocabulary import FLOAT_DTYPES

#: torch checks that every stride but the unit one is a multiple of 16 bytes.
_STRIDE_BYTES = 16
#: GroupMM.cu: ``TORCH_CHECK(group_count < 1024)`` for the CUTLASS kernel.
_CUDA_MAX_GROUPS = 1023
#: Offsets are int32 (torch requires it), so every row index must fit.
_MAX_ROWS = 2**31 - 1
#: Archs where empty wgrad groups are written as zeros by torch itself.
_ZEROES_EMPTY_GROUPS = ("cpu", "sm_9")
#: On a CPU device: just above ``reference`` (0), below any CPU kernel plugin. torch's CPU
#: path is the same per-group ``mm`` loop as ``reference`` without the fp32 upcast.
CPU_PRIORITY = 5
#: c10::utils::check_env's spellings of "true".
_ENV_TRUE = {"1", "on", "yes", "true", "y"}
_CK_ENV = "ROCM_ALLOW_GROUP_GEMM_CK"


def _grouped_mm_op() -> Callable[..., torch.Tensor] | None:
    """``torch._grouped_mm`` (the op itself: ``F.grouped_mm`` is a Python frame around it,
    a few tenths of a us per call), else ``torch.nn.functional.grouped_mm``."""
    return getattr(torch, "_grouped_mm", None) or getattr(torch.nn.functional, "grouped_mm", None)


_GROUPED_MM = _grouped_mm_op()


@functools.cache
def _cpu_kernel_error() -> str | None:
    """Why this torch cannot run ``_grouped_mm`` on CPU tensors (None: it can). The probe's
    tensors are on the CPU whatever torch's default device: the answer is kept for the
    process, and a first check under a GPU or meta default would have probed that device."""
    if _GROUPED_MM is None:
        return "this torch has no torch._grouped_mm"
    try:
        _GROUPED_MM(
            torch.ones(2, 8, dtype=torch.bfloat16, device="cpu"),
            torch.ones(1, 8, 8, dtype=torch.bfloat16, device="cpu").transpose(-2, -1),
            offs=torch.tensor([2], dtype=torch.int32, device="cpu"),
        )
    except (RuntimeError, NotImplementedError) as exc:
        return f"this torch has no CPU kernel for torch._grouped_mm ({type(exc).__name__})"
    return None


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if torch and the kernel take it as a row-major operand, else a copy.

    The rule is torch's stride check (unit last stride, other strides 16-byte multiples
    at least the row length) plus a 16-byte aligned base pointer on the GPU. Row-major
    2-D operands also keep the CUTLASS kernel off its device-side per-group alignment
    asserts, which only apply to column-major ragged operands. Written out for the 2-D
    and 3-D operands every call passes (it runs twice per call); other ranks take the
    general test.
    """
    shape = t.shape
    if t.is_contiguous() and shape[0] > 1 and shape[-2] > 1 and (t.is_cpu or t.data_ptr() % _STRIDE_BYTES == 0):
        # The common case in four C calls: contiguous with no size-1 dim among the leading
        # ones has exactly the row-major strides, and eligibility makes its rows 16-byte
        # multiples (N and K); a size-1 dim may carry any stride, so it takes the full test.
        return t
    strides = t.stride()
    unit = _STRIDE_BYTES // t.element_size()
    ndim = len(strides)
    if ndim == 2 or ndim == 3:
        row = strides[-2]
        rows_ok = strides[-1] == 1 and row % unit == 0 and row >= max(1, t.shape[-1])
        rows_ok = rows_ok and (ndim == 2 or strides[0] % unit == 0)
    else:
        rows_ok = strides[-1] == 1 and all(s % unit == 0 for s in strides[:-1])
        rows_ok = rows_ok and strides[-2] >= max(1, t.shape[-1])
    if rows_ok and (t.is_cpu or t.data_ptr() % _STRIDE_BYTES == 0):
        return t
    copy = t.contiguous()
    # contiguous() hands back ``t`` itself when only a size-1 dim has an odd stride, and
    # a base it did not move stays misaligned: both need a real copy.
    if copy is t or (copy.data_ptr() % _STRIDE_BYTES and not copy.is_cpu):
        copy = t.clone(memory_format=torch.contiguous_format)
    return copy


def _availability(problem: Problem) -> list[Reason]:
    """The op itself: present in this torch, on the CPU, and on ROCm only with CK opted in."""
    if _GROUPED_MM is None:
        return [Reason("missing", f"torch {torch.__version__} has no torch._grouped_mm")]
    if problem.placement == "cpu" and (error := _cpu_kernel_error()):
        return [Reason("missing", error)]
    if problem.device.vendor == "rocm" and os.environ.get(_CK_ENV, "").strip().lower() not in _ENV_TRUE:
        return [Reason("config", f"{_CK_ENV} is not set: torch runs its per-group fallback loop (host sync) on ROCm")]
    return []


def _dtypes(problem: Problem) -> list[Reason]:
    """bf16 only on GPUs (the grouped kernels); the result dtype is the input dtype."""
    fmt = problem.a_format
    reasons = []
    if problem.device.vendor != "cpu" and fmt != "bfloat16":
        reasons.append(
            Reason(
                "dtype",
                f"{fmt} on {problem.device.arch} goes through torch's per-group fallback loop "
                "(host sync, not capturable); its grouped kernel takes bfloat16 only",
            )
        )
    if problem.out_dtype != fmt:
        reasons.append(Reason("dtype", f"out dtype {problem.out_dtype} is not the input dtype {fmt} (torch: same)"))
    return reasons


def _shape(problem: Problem) -> list[Reason]:
    """16-byte strides, int32 offsets, and the CUTLASS kernel's group limit."""
    reasons = []
    if problem.a_format in FLOAT_DTYPES:
        multiple = _STRIDE_BYTES // FLOAT_DTYPES[problem.a_format].itemsize
        for dim, value in (("N", problem.n), ("K", problem.k)):
            if value % multiple or value == 0:
                reasons.append(
                    Reason("align", f"{dim}={value} is not a positive multiple of {multiple} (16-byte strides)")
                )
    # The whole bucket: a decision is shared by every M of its power-of-two bucket, so one
    # made for M=2**30+1 ran M=2**31 too, whose last end does not fit (it wraps on the device).
    if problem.m_bucket > _MAX_ROWS:
        reasons.append(
            Reason(
                "shape",
                f"M={problem.m} shares its decision with M up to {problem.m_bucket}, past the int32 "
                "offsets torch takes",
            )
        )
    if problem.device.vendor == "cuda" and problem.groups > _CUDA_MAX_GROUPS:
        reasons.append(Reason("groups", f"G={problem.groups} exceeds the CUTLASS kernel's limit {_CUDA_MAX_GROUPS}"))
    return reasons


def _recipe(problem: Problem) -> list[Reason]:
    """a16w4 only for wgrad, whose operands the recipe keeps unquantized."""
    if problem.recipe == "a16w4" and problem.op != "wgrad":
        return [
            Reason("recipe", f"a16w4 {problem.op} multiplies MXFP4 weights; only its wgrad (bf16 x bf16) runs here")
        ]
    return []


def _call(problem: Problem) -> list[Reason]:
    """Weight lists (fwd / dgrad) and host splits under capture."""
    reasons = []
    if problem.weight_list and problem.op != "wgrad":
        reasons.append(Reason("layout", "a list of G weights would be stacked into one (G, N, K) copy every call"))
    if problem.capturing and problem.host_splits:
        reasons.append(Reason("capture", "m_splits are a host list: the graph would keep them; pass a device tensor"))
    return reasons


class TorchGroupedMMBackend(Backend):
    """``torch._grouped_mm`` with device offsets: fwd and dgrad 2-D x 3-D, wgrad 2-D x 2-D."""

    spec = BackendSpec(
        name="torch_grouped_mm",
        version=f"{__version__}+torch{torch.__version__}",
        description="torch._grouped_mm: CUTLASS on sm_90/sm_100, CK on gfx942/gfx950 (opt-in), "
        "torch's mm loop on CPU; device offsets, capturable",
        ops=frozenset({"fwd", "dgrad", "wgrad"}),
        # a16w4's wgrad multiplies its bf16 gradients by its bf16 activations: a plain GEMM.
        recipes=frozenset({"bf16", "fp16", "fp32", "a16w4"}),
        vendors=frozenset({"cpu", "cuda", "rocm"}),
        archs=("cpu", "sm_9*", "sm_10*", "gfx942", "gfx950"),
        host_splits=False,
        accumulate=True,
        weight_list=True,
        non_contiguous=True,
        deterministic=True,
        priority=50,
    )

    def check(self, problem: Problem) -> list[Reason]:
        return _recipe(problem) + _availability(problem) + _dtypes(problem) + _shape(problem) + _call(problem)

    def priority(self, problem: Problem) -> int:
        """The declared 50 on GPUs; ``CPU_PRIORITY`` on a CPU device."""
        return CPU_PRIORITY if problem.device.vendor == "cpu" else self.spec.priority

    def run(self, problem: Problem, inputs: GroupedInputs) -> torch.Tensor | list[torch.Tensor]:
        if problem.op == "wgrad":
            return self._wgrad(problem, inputs)
        a, w = inputs.a, inputs.b
        # ``_row_major``'s common case for both operands at once, from what the Problem
        # already knows (both contiguous, no size-1 leading dim, so row-major strides): only
        # the base pointers are read per call.
        if not (
            problem.contiguous
            and problem.m > 1
            and problem.groups > 1
            and problem.n > 1
            and (a.is_cpu or (a.data_ptr() % _STRIDE_BYTES == 0 and w.data_ptr() % _STRIDE_BYTES == 0))
        ):
            a, w = _row_major(a), _row_major(w)
        if problem.m == 0:
            return inputs.output(problem)
        offsets = inputs.offsets(a.device)
        result = _GROUPED_MM(a, w.mT if problem.op == "fwd" else w, offs=offsets)
        if inputs.out is None:
            return result
        return inputs.out.copy_(result)

    def _wgrad(self, problem: Problem, inputs: GroupedInputs) -> torch.Tensor | list[torch.Tensor]:
        out = inputs.out
        if problem.m == 0:
            return self._no_rows(problem, inputs)
        dy = _row_major(inputs.a)
        x = _row_major(inputs.b)
        dw = _GROUPED_MM(dy.t(), x, offs=inputs.offsets(dy.device))
        if not problem.device.arch.startswith(_ZEROES_EMPTY_GROUPS):
            _clear_empty_groups(dw, inputs)
        if out is None:
            return dw
        if isinstance(out, list):
            if problem.accumulate:
                torch._foreach_add_(out, list(dw.unbind(0)))
            else:
                torch._foreach_copy_(out, list(dw.unbind(0)))
            return out
        return out.add_(dw) if problem.accumulate else out.copy_(dw)

    def _no_rows(self, problem: Problem, inputs: GroupedInputs) -> torch.Tensor | list[torch.Tensor]:
        """wgrad with M = 0 (torch rejects a zero-length contraction dim): zeros or untouched."""
        out = inputs.output(problem)
        if not problem.accumulate:
            if isinstance(out, list):
                torch._foreach_zero_(out)
            else:
                out.zero_()
        return out


def _clear_empty_groups(dw: torch.Tensor, inputs: GroupedInputs) -> None:
    """Zero the groups without rows where the kernel leaves them unwritten.

    Host splits: one indexed fill of the empty groups. Device splits: a masked fill over
    all of ``dw`` (one extra read and write of G*N*K elements), which needs no sync.
    """
    splits = inputs.m_splits
    if isinstance(splits, torch.Tensor):
        dw.masked_fill_((splits.to(dw.device) == 0).view(-1, 1, 1), 0)
        return
    empty = [g for g, rows in enumerate(splits) if rows == 0]
    if empty:
        dw.index_fill_(0, torch.tensor(empty, device=dw.device), 0)


@hookimpl
def grouped_gemm_backends() -> list[Backend]:
    return [TorchGroupedMMBackend()]
