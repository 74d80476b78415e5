"""The ``triton_grouped`` backend: the Triton MX package's persistent kernels on plain bf16 /
fp16 operands, with fp32 results allowed.

fwd and dgrad run ``grouped_kernel`` (the MX kernels' device tile schedule and contraction
loop, ``tl.dot`` on 16-bit tiles); wgrad runs the MX package's ``wgrad_grouped_kernel``
on its plain-dot path, which takes unpadded group ends. Every call is one launch reading
the splits on the device: no host sync, CUDA-graph capturable. What it adds over the
other bf16 backends is wgrad with ``accumulate=True`` into an fp32 ``out`` (Megatron's
``main_grad``): ``torch._grouped_mm`` cannot write fp32 and ``multistream`` reads the
splits on the host, one GEMM per group.

Priority, from the H200 measurement (docs/backends.md): on GPUs below ``torch_grouped_mm``
(50), which was faster on balanced splits of large groups (this kernel wins on their
skewed splits, which device splits hide from the host: autotuning picks it there), and
above ``multistream`` (20), so that fp32 results, fp32 accumulation and fp16 (which
``torch_grouped_mm`` refuses on GPUs) come here; above ``torch_grouped_mm`` for fwd /
dgrad of decode with large experts, where it streams the weights near the memory limit,
and of 64-128 rows per group, where it measured faster on every shape tried; below
``multistream`` for a host-split wgrad of few groups, where per-group vendor GEMMs were
faster. On a CPU device the interpreter is a test vehicle only: it ranks below
``reference``.
"""

from __future__ import annotations

from typing import Any

import torch

from grouped_gemm import Backend, BackendSpec, GroupedInputs, Problem, Reason, __version__
from grouped_gemm.backends.triton_mx import launch

#: Between ``multistream`` (20) and ``torch_grouped_mm`` (50) on GPUs; see the module docstring.
PRIORITY = 30
#: Below ``reference`` (0): on the CPU the kernels run in Triton's interpreter, for tests.
CPU_PRIORITY = -1
#: wgrad of few large groups with host splits: below ``multistream`` (20). On the H200
#: (2026-12-04, benchmarks/wgrad_accumulate.py) accumulating into an fp32 main_grad took
#: 4.63 ms here against 2.94 ms for multistream on dsv3_gateup_ep8 (G=32), while on the
#: 128-group cases this kernel was 0.97-7.1x multistream's speed.
FEW_LARGE_GROUPS_WGRAD_PRIORITY = 15
#: At most this many groups count as few (the measured cases have 32 and 128).
FEW_GROUPS = 64
#: fwd / dgrad in the decode regime: above ``torch_grouped_mm`` (50). With a few rows per
#: expert the call streams the weights; on the H200 (2026-12-04, benchmarks/autotune.py,
#: public API) this kernel read them at 4.4 TB/s where ``torch._grouped_mm`` reached
#: 3.0 TB/s: 1.38-1.52x on dsv3_gateup_decode (G=32, 16 rows per group, N*K 29 M) and
#: gptoss120b_gateup_decode (G=128, 2 rows, N*K 16.6 M). qwen3_30b_gateup_decode's
#: smaller experts (4 rows, N*K 3.1 M) ranged 0.68-1.23x with the earlier 128 x 128
#: tiles, then 1.41-1.49x and 1.41-1.53x in two runs of the 128 x 256 tiles (2026-12-04,
#: ``grouped-gemm bench --device-splits``, balanced and skewed, fwd and dgrad).
DECODE_PRIORITY = 60
#: Decode: at most this many rows per group on average (M's bucket / G: one route serves
#: every M of a power-of-two bucket; the measured decode cases have M a power of two).
DECODE_MEAN_ROWS = 16
#: ... and experts of at least this many weight elements (N * K): the smallest measured
#: expert (qwen3-30B, 3.1 M) rounded down to a power of two; smaller ones are unmeasured.
DECODE_MIN_WEIGHT = 1 << 21
#: fwd / dgrad with MID_MEAN_ROWS rows per group on average (M's bucket / G): above
#: ``torch_grouped_mm``.
#: On the H200 (2026-12-04, ``grouped-gemm bench --rows-per-group``, device splits) this
#: kernel was 1.01-1.63x ``torch._grouped_mm`` at 64 and 128 rows on six expert shapes
#: (gpt-oss down, qwen3-30B down and gate-up, dsv3 down, mixtral down, qwen3-235B
#: gate-up), balanced and skewed; at 256 rows only on skewed splits (0.87-0.96x balanced),
#: which the host cannot see in device splits, so larger groups stay with torch. Read by
#: M's bucket, the range takes M from just over 32 rows a group (G a power of two): 33-63
#: rows were not timed, but the lead grew as groups shrank (64 rows 1.24-1.63x, decode
#: 1.37-1.53x).
MID_PRIORITY = 55
MID_MEAN_ROWS = (64, 128)
#: 16-byte rows (8 elements of 16 bits) for N and K: Triton's vectorized loads. The masked
#: kernels are correct for any N and K; unaligned rows are left to the other backends.
ALIGNMENT = 8
#: Weight offsets within one group (``n * k``) are int32 in the kernels.
_MAX_WEIGHT_ELEMENTS = 2**31 - 1


class TritonGroupedBackend(Backend):
    """Persistent Triton grouped GEMM on bf16 / fp16 operands (fwd, dgrad, wgrad)."""

    spec = BackendSpec(
        name="triton_grouped",
        version=__version__,
        description="persistent Triton bf16/fp16 grouped GEMM, fp32 results and fp32 wgrad accumulation; "
        "device splits, capturable. Priority 30: below torch_grouped_mm, above multistream; "
        "60 for decode with large experts, 55 for 64-128 rows per group, 15 for a host-split wgrad of few groups "
        "(H200 measurements)",
        ops=frozenset({"fwd", "dgrad", "wgrad"}),
        # fp32 is not offered: tl.dot on fp32 tiles multiplies in tf32.
        recipes=frozenset({"bf16", "fp16"}),
        dtypes=frozenset({"bfloat16", "float16"}),
        out_dtypes=frozenset({"bfloat16", "float16", "float32"}),
        # Chips with at least 160 KB of shared memory per SM, which the 4-stage tiles of
        # launch.grouped_config need (about 100-130 KB per program). Not ROCm: 64 KB of LDS.
        vendors=frozenset({"cpu", "cuda"}),
        archs=("cpu", "sm_80", "sm_90", "sm_100", "sm_103"),
        n_multiple=ALIGNMENT,
        k_multiple=ALIGNMENT,
        # MAX_G entries of the tile schedule live in registers (as in the MX backends).
        max_groups=1024,
        host_splits=False,
        accumulate=True,
        weight_list=False,
        non_contiguous=False,
        deterministic=True,
        priority=PRIORITY,
    )

    def check(self, problem: Problem) -> list[Reason]:
        reasons = launch.placement_reasons(problem)
        if problem.out_dtype not in (problem.a_format, "float32"):
            reasons.append(
                Reason("dtype", f"out dtype {problem.out_dtype} from {problem.a_format}; writes that dtype or float32")
            )
        if problem.n * problem.k > _MAX_WEIGHT_ELEMENTS:
            reasons.append(Reason("shape", f"N*K={problem.n * problem.k} per group exceeds int32 offsets"))
        return reasons

    def priority(self, problem: Problem) -> int:
        """``PRIORITY`` on GPUs; above ``torch_grouped_mm`` for fwd / dgrad of decode with
        large experts and of 64-128 rows per group; below ``multistream`` for a host-split
        wgrad of few groups (where its per-group vendor GEMMs were faster); ``CPU_PRIORITY``
        on a CPU device.
        With device splits it stays first: ``multistream`` would read them back (a sync)."""
        if problem.device.vendor == "cpu":
            return CPU_PRIORITY
        if problem.op == "wgrad":
            if problem.host_splits and problem.groups <= FEW_GROUPS:
                return FEW_LARGE_GROUPS_WGRAD_PRIORITY
        elif problem.m_bucket <= DECODE_MEAN_ROWS * problem.groups and problem.n * problem.k >= DECODE_MIN_WEIGHT:
            return DECODE_PRIORITY
        elif MID_MEAN_ROWS[0] * problem.groups <= problem.m_bucket <= MID_MEAN_ROWS[1] * problem.groups:
            return MID_PRIORITY
        return self.spec.priority

    def run(self, problem: Problem, inputs: GroupedInputs) -> torch.Tensor:
        return self.run_config(problem, inputs, None)

    def configs(self, problem: Problem) -> list[dict[str, int]]:
        """Kernel tiles for autotuning: the plain grouped kernel's (fwd, dgrad) or the wgrad
        kernel's candidates (``launch``), none for CPU tensors."""
        if problem.op == "wgrad":
            return launch.offered(problem, launch.wgrad_configs())
        return launch.offered(problem, launch.grouped_configs(problem.m, problem.groups))

    def run_config(self, problem: Problem, inputs: GroupedInputs, config: dict[str, Any] | None) -> torch.Tensor:
        """``run`` with the tiles of one of ``configs(problem)`` (None: the defaults)."""
        out = inputs.output(problem)
        device = inputs.a.device
        if problem.op == "wgrad":
            tiles = launch.parse_config(launch.WgradConfig, config)
            if not problem.m:  # no rows to launch over (and no operand memory to point at)
                return out if problem.accumulate else out.zero_()
            ends = inputs.offsets(device)
            return launch.launch_wgrad(inputs.a, inputs.b, ends, out, problem.groups, problem.accumulate, tiles)
        grouped_tiles = launch.parse_config(launch.GroupedConfig, config)
        if problem.m:
            splits = launch.device_splits(inputs.m_splits, device, inputs.capturing)
            launch.launch_grouped(
                inputs.a, inputs.b, splits, out, transpose_w=problem.op == "fwd", config=grouped_tiles
            )
        return out
