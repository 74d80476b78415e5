"""The ``hip_mxfp8`` backend: what it declares, what it checks, and how it runs a call.

A compiled extension (``csrc/``, built on first use by ``build``). The kernels multiply
contraction-major E4M3 operands with E8M0 scales per 32-element block; this module brings
every op to that form:

======  =================================  ========================================
op      a (rows x contraction)             b (columns x contraction, per group)
======  =================================  ========================================
fwd     x along K, as quantized            w along K, as quantized: (G, N, K)
dgrad   dy along N, as quantized           w along N, as quantized: (G, N, K), k-outer
wgrad   dy along M per group, k-outer      x along M per group, k-outer: (M', K)
======  =================================  ========================================

A k-outer operand (contraction along its first axis) is read as it is and transposed on
chip by the kernel; that needs its other axis to be whole 16-byte lines (K for dgrad, N and
K for wgrad). Where it is not, the operand is transposed by a ``torch`` copy on the device
first (no sync; the 1-byte copy is slow: on the H200 it cost dgrad most of its time).
Contraction lengths that are not multiples of 32 are zero-padded by the quantizer
(``pad=True``); wgrad pads every group's tokens to 32.
"""

from __future__ import annotations

import torch

from grouped_gemm import Backend, BackendSpec, GroupedInputs, MXTensor, Problem, Reason, __version__
from grouped_gemm.backends.hip_mxfp8 import build
from grouped_gemm.errors import InvalidArgumentError
from grouped_gemm.mx import quantize_mx, quantize_mx_rows, quantize_mx_weight

#: Output rows per tile of the rows kernel (mxfp8_grouped.cuh: BM).
TILE_ROWS = 128
BLOCK = 32
#: A k-outer operand is copied in 16-byte lines along its rows (csrc: StageLoader::copy_codes).
K_OUTER_LINE = 16
#: The HipKittens gfx950 MXFP8 grouped GEMM contract (ROCm TransformerEngine PR 661),
#: declared for gfx950 so this backend is never chosen where that kernel would refuse.
HK_MAX_GROUPS = 512
PRIORITY = {"sm_89": 30, "sm_90": 30, "gfx950": 10}
#: sm_90 fwd / dgrad of small groups: above ``triton_mxfp8`` (80). On an H100 (2026-12-06,
#: benchmarks/autotune.py, public API, weights quantized in the call, ``triton_mxfp8`` with
#: its 16 x 2 E4M3 prep tile) this backend's fwd took 0.88-0.93x the time of
#: ``triton_mxfp8``'s on gpt-oss gate-up and down (128 rows a group, balanced and skewed),
#: 0.99-1.02x on the 2- and 16-row decode cases and 1.07-1.09x on qwen3-30B's 4-row decode;
#: dgrad (before that tile; its own prep tile barely moved) 0.88-0.89x on gpt-oss.
#: ``triton_mxfp8`` was faster on 22 of the 28 larger-group fwd / dgrad problems even
#: before its new tile. With pre-quantized (``MXTensor``) weights, on another H100 the same
#: day (``grouped-gemm bench --recipe mxfp8 --mx-weights prequantized``, both backends in
#: one run): 0.81-0.95x ``triton_mxfp8``'s time on all eight gpt-oss fwd / dgrad rows,
#: slower on every row with 256 rows a group or more (docs/performance.md, "The
#: twenty-fifth session").
SMALL_GROUPS_PRIORITY = 85
#: Rows a group on average (M's bucket / G, as one route serves the bucket) that count as
#: small: above the decode cases' 16, up to gpt-oss's 128 (the measured ends; nothing
#: between them was timed).
SMALL_GROUP_MEAN_ROWS = (16, 128)


class HipMxfp8Backend(Backend):
    """MXFP8 grouped GEMM in compiled CUDA/HIP: f16 products of prescaled E4M3 codes (wgmma on
    sm_90a), per-block scale promotion where a tile's scales spread too widely for that."""

    spec = BackendSpec(
        name="hip_mxfp8",
        version=__version__,
        description="compiled MXFP8 grouped GEMM (built on first use): codes prescaled to f16 by their "
        "block scales on wgmma (sm_90a), per-32-block promotion where scales spread "
        "widely; portable inner product on gfx950; above triton_mxfp8 for sm_90 fwd / dgrad of 17-128 "
        "rows a group with high-precision weights (H100 measurements), below it elsewhere",
        ops=frozenset({"fwd", "dgrad", "wgrad"}),
        recipes=frozenset({"mxfp8"}),
        vendors=frozenset({"cuda", "rocm"}),
        archs=("sm_89", "sm_90", "gfx942", "gfx950"),
        dtypes=frozenset({"bfloat16", "float16", "float32"}),
        out_dtypes=frozenset({"bfloat16", "float32"}),
        mx_formats=frozenset({"e4m3"}),
        host_splits=False,
        accumulate=True,
        weight_list=False,
        non_contiguous=False,
        deterministic=True,
        priority=30,
    )

    def check(self, problem: Problem) -> list[Reason]:
        reasons = _recipe_reasons(problem) + _arch_reasons(problem)
        if problem.op == "wgrad":
            reasons += _wgrad_reasons(problem)
        if problem.capturing and problem.host_splits:
            reasons.append(Reason("capture", "m_splits are a host list the graph would keep; pass a device tensor"))
        # Only a problem this backend would otherwise run is worth a build (or its reason).
        if not reasons and problem.device.arch in self.spec.archs and problem.recipe in self.spec.recipes:
            reasons += _build_reasons(problem)
        return reasons

    def prepare(self, problem: Problem) -> list[Reason]:
        """Build the kernels for this GPU's arch (compiled once per machine into the cache,
        then loaded): only when this backend is about to run, not on every decision (a first
        mxfp8 call on an H200 waited for this build although ``triton_mxfp8`` ran it)."""
        if not _builds_here(problem) or problem.capturing:
            return []  # check() has reported what is known
        # A known outcome is answered as it is: another thread's build may have failed
        # between this decision's check() and now.
        outcome = build.result(problem.device.arch) or build.ensure(problem.device.arch, problem.device.vendor)
        return [] if outcome.ok else [_build_reason(outcome)]

    def priority(self, problem: Problem) -> int:
        """``SMALL_GROUPS_PRIORITY`` for sm_90 fwd / dgrad of 17-128 rows a group (on average),
        where it measured faster than ``triton_mxfp8`` (80) with weights quantized in the
        call and pre-quantized; else 30 on sm_90 (below it), 10 on gfx950 (docs/backends.md)."""
        fewest, most = SMALL_GROUP_MEAN_ROWS
        small = fewest * problem.groups < problem.m_bucket <= most * problem.groups
        if problem.device.arch == "sm_90" and problem.op != "wgrad" and small:
            return SMALL_GROUPS_PRIORITY
        return PRIORITY.get(problem.device.arch, self.spec.priority)

    def status(self) -> str:
        """This process's build outcome per arch, or where the build would go."""
        tried = [str(r) for r in build.all_results()]
        if tried:
            return "; ".join(tried)
        try:
            return f"not built in this process (cache: {build.cache_root()})"
        except OSError as exc:
            return f"not built in this process (no cache directory: {exc})"

    def build(self) -> Reason | None:
        """Build for this machine's GPU now (``grouped-gemm build``); None when built."""
        if not torch.cuda.is_available():
            vendor = "rocm" if torch.version.hip else "cuda"
            reason = build.blocker(vendor) or "torch sees no GPU"
            return Reason("build", reason)
        from grouped_gemm.device import device_info

        info = device_info(torch.device("cuda", torch.cuda.current_device()))
        outcome = build.ensure(info.arch, info.vendor)
        return None if outcome.ok else _build_reason(outcome)

    def run(self, problem: Problem, inputs: GroupedInputs) -> torch.Tensor:
        module = build.ensure(problem.device.arch, problem.device.vendor).module
        if problem.op == "wgrad":
            return _run_wgrad(module, problem, inputs)
        return _run_rows(module, problem, inputs)


def _recipe_reasons(problem: Problem) -> list[Reason]:
    if problem.op != "fwd" and problem.grad_format not in (None, "e4m3"):
        return [
            Reason(
                "recipe",
                f"grad_format {problem.grad_format} not supported: the kernels multiply e4m3 x e4m3 "
                "(mma.sync .e4m3.e4m3); use grad_format e4m3",
            )
        ]
    return []


def _wgrad_reasons(problem: Problem) -> list[Reason]:
    """Pre-quantized wgrad operands are read at the tight group starts, so every group must
    be whole 32-token blocks: the core checks that on host splits only."""
    quantized = problem.a_format.startswith("mx_"), problem.b_format.startswith("mx_")
    if quantized[0] != quantized[1]:
        return [Reason("layout", "wgrad takes dy and x both pre-quantized or both high precision")]
    if quantized[0] and not problem.host_splits:
        return [
            Reason(
                "layout",
                "pre-quantized wgrad operands need host splits (every group whole 32-token blocks, "
                "which device splits do not let the core check); pass bf16 dy and x to quantize here",
            )
        ]
    return []


def _arch_reasons(problem: Problem) -> list[Reason]:
    arch = problem.device.arch
    if arch == "gfx942":
        return [
            Reason(
                "arch",
                "gfx942's fp8 MFMA takes the FNUZ e4m3 encoding (bias 8, 0x80 is NaN); this backend has no "
                "exact OCP -> FNUZ conversion, so it does not run there",
            )
        ]
    if arch == "sm_89":
        return [
            Reason(
                "arch",
                "the fwd / dgrad kernels' pipeline takes 120-140 KB of shared memory per block (three stages "
                "of 40 KB); sm_89 allows 99 KB, so it does not run there",
            )
        ]
    if arch != "gfx950":
        return []
    return _hipkittens_contract(problem)


def _hipkittens_contract(problem: Problem) -> list[Reason]:
    """gfx950: the HipKittens grouped MXFP8 contract, in GEMM terms (rows x columns x contraction)."""
    reasons = []
    if problem.groups > HK_MAX_GROUPS:
        reasons.append(Reason("groups", f"G={problem.groups} exceeds the gfx950 contract's {HK_MAX_GROUPS}"))
    if problem.op == "wgrad":
        rows_multiple = 128
        rules = (("N", problem.n, 256), ("K", problem.k, 256))
    else:
        rows_multiple = 256
        cols, contraction = ("N", "K") if problem.op == "fwd" else ("K", "N")
        size = {"N": problem.n, "K": problem.k}
        rules = ((cols, size[cols], 256), (contraction, size[contraction], 128))
        if size[contraction] < 256:
            reasons.append(Reason("shape", f"{contraction}={size[contraction]} (the contraction) is below 256"))
    for dim, value, multiple in rules:
        if value % multiple:
            reasons.append(Reason("align", f"{dim}={value} is not a multiple of {multiple} (gfx950 contract)"))
    if problem.m_align == 0:
        reasons.append(
            Reason("align", f"needs every group's rows to be a multiple of {rows_multiple}; device splits are not read")
        )
    elif problem.m_align < rows_multiple:
        reasons.append(
            Reason(
                "align",
                f"needs every group's rows to be a multiple of {rows_multiple}; the splits are known to be "
                f"multiples of {problem.m_align} only",
            )
        )
    return reasons


def _build_reason(outcome: build.BuildResult) -> Reason:
    return Reason("build", f"{outcome.error}; log: {outcome.log}")


def _build_reasons(problem: Problem) -> list[Reason]:
    """A known or certain build failure (cheap: every decision asks); the build itself waits
    for ``prepare``, when this backend is about to run."""
    arch, vendor = problem.device.arch, problem.device.vendor
    outcome = build.result(arch)
    if outcome is None:
        if build.blocker(vendor) is not None:
            outcome = build.ensure(arch, vendor)  # no compiler to try: fails at once, with its log
        elif _builds_here(problem) and problem.capturing:
            return [
                Reason(
                    "capture",
                    "the kernels are not built yet and cannot be compiled during CUDA-graph capture; "
                    "run `grouped-gemm build hip_mxfp8` or one call before capturing",
                )
            ]
        else:
            return []  # built by prepare where it runs (a described device: never here)
    return [] if outcome.ok else [_build_reason(outcome)]


def _builds_here(problem: Problem) -> bool:
    """Whether the problem's device is this machine's GPU, where the kernels are built."""
    return problem.device.detected and problem.placement == "cuda"


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned (the kernels load 16 bytes at a time)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _operand(problem: Problem, t: torch.Tensor | MXTensor, name: str, axis: int, fmt: str = "e4m3") -> MXTensor:
    """``t`` as an e4m3 MXTensor with blocks of 32 along ``axis``: as given, or quantized."""
    if isinstance(t, MXTensor):
        if t.fmt != fmt or t.axis != axis or t.block_size != BLOCK:
            raise InvalidArgumentError(name, t, f"an e4m3 MXTensor with blocks of {BLOCK} along axis {axis}")
        return t
    if t.dim() == 3:
        return quantize_mx_weight(t, fmt, op=problem.op, scale_rule=problem.scale_rule, pad=True)
    return quantize_mx(t, fmt, axis=axis, scale_rule=problem.scale_rule, pad=True)


def _run_rows(module: object, problem: Problem, inputs: GroupedInputs) -> torch.Tensor:
    out = inputs.output(problem)
    if problem.m == 0:
        return out
    a = _operand(problem, inputs.a, "x" if problem.op == "fwd" else "dy", 1)
    w = _operand(problem, inputs.b, "w", 2 if problem.op == "fwd" else 1)
    if a.data.shape[1] != w.data.shape[w.axis]:
        raise InvalidArgumentError(
            "w", w, f"a padded contraction length equal to the activation's ({a.data.shape[1]}); pad both alike"
        )
    # dgrad's weight, (G, N', K) blocked along N, is k-outer: read as it is where K allows.
    k_outer = problem.op == "dgrad" and w.data.shape[2] % K_OUTER_LINE == 0
    if problem.op == "fwd" or k_outer:
        w_data, w_scale = _aligned(w.data), _aligned(w.scale)
    else:  # -> contraction-major (G, K, N')
        w_data, w_scale = _aligned(w.data.transpose(1, 2)), _aligned(w.scale.transpose(1, 2))
    ends = inputs.offsets(out.device)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    tile_ends = torch.cumsum((sizes + TILE_ROWS - 1) // TILE_ROWS, 0, dtype=torch.int32)
    max_tiles = -(-problem.m // TILE_ROWS) + problem.groups
    module.rows_gemm(_aligned(a.data), _aligned(a.scale), w_data, w_scale, ends, tile_ends, max_tiles, out, k_outer)
    return out


def _token_major(
    problem: Problem, inputs: GroupedInputs, device: torch.device
) -> tuple[MXTensor, MXTensor, torch.Tensor]:
    """wgrad's dy and x blocked along the tokens, and the (G,) ends of each group's tokens:
    pre-quantized operands as given (every group whole blocks, checked by the core), else
    quantized per group with the tokens padded to 32 (``gg.quantize_mx_rows``)."""
    if isinstance(inputs.a, MXTensor):
        dy = _operand(problem, inputs.a, "dy", 0)
        x = _operand(problem, inputs.b, "x", 0)
        return dy, x, inputs.offsets(device)
    rule = problem.scale_rule
    dy_rows = quantize_mx_rows(inputs.a, inputs.m_splits, "e4m3", align=BLOCK, scale_rule=rule)
    x_rows = quantize_mx_rows(inputs.b, inputs.m_splits, "e4m3", align=BLOCK, scale_rule=rule)
    return dy_rows.tensor, x_rows.tensor, dy_rows.padded_offsets[1:]


def _run_wgrad(module: object, problem: Problem, inputs: GroupedInputs) -> torch.Tensor:
    device = inputs.a.device
    out = inputs.output(problem)
    if problem.m == 0:
        return out if problem.accumulate else out.zero_()
    dy, x, token_ends = _token_major(problem, inputs, device)
    k_outer = dy.data.shape[1] % K_OUTER_LINE == 0 and x.data.shape[1] % K_OUTER_LINE == 0
    operands = (dy.data, dy.scale, x.data, x.scale) if k_outer else (dy.data.t(), dy.scale.t(), x.data.t(), x.scale.t())
    module.wgrad_gemm(*(_aligned(t) for t in operands), token_ends, out, problem.accumulate, k_outer)
    return out
