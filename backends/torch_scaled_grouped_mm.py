"""Backend ``torch_scaled_grouped_mm``: PyTorch's own MXFP8 grouped GEMM.

``torch.nn.functional.scaled_grouped_mm`` with ``BlockWise1x32`` E8M0 scales, one launch
for all groups, group ends read on the device (no host sync, graph-capturable). What it
declares follows torch's own checks (``aten/src/ATen/native/cuda/GroupedBlas.cpp``:
``_check_mslk_grouped_inputs``, ``_check_scales_blocked``, ``_mx8_mx8_bf16_grouped_mm_mslk``;
the meta function in ``torch/_meta_registrations.py``), as of torch 2.13:

- the MXFP8 kernel is MSLK's, CUDA only, compute capability 10.x only (sm_100 / sm_103),
  and only in a torch built with ``USE_MSLK`` (else ``NotImplementedError``: this backend
  probes once on the first real call and turns that into a reason);
- 2-D x 3-D (fwd, dgrad) and 2-D x 2-D (wgrad) layouts, 1 to 1024 groups, both operands
  ``float8_e4m3fn``, bf16 output only;
- ``mat_a`` row-major, ``mat_b`` column-major, the contraction a multiple of 16 (MX: 32)
  and ``mat_b``'s other dimension a multiple of 16;
- scales ``float8_e8m0fnu`` in the ``SWIZZLE_32_4_4`` blocked layout: per (group of) matrix,
  rows padded to 128 and scale columns to 4, stored as 128 x 4 tiles in which row r and
  column c sit at byte ``(r % 32) * 16 + (r // 32) * 4 + c`` (``swizzle_32_4_4``). The 3-D
  operand's scales are ``(G, rows' * cols')``; the ragged 2-D operand's scales are each
  group's rows padded to 128 and blocked on their own, concatenated (``group_blocked_rows``).

wgrad (2-D x 2-D, contraction ragged per group: each group's scale columns padded to 4)
is not wrapped: reason ``op``. Nothing here has run on an sm_100 GPU: the layouts follow
torch's checks and are tested on the CPU only (tests/test_torch_scaled_grouped_mm.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from grouped_gemm import Backend, BackendSpec, GroupedInputs, MXTensor, Problem, Reason, __version__, hookimpl
from grouped_gemm.errors import InvalidArgumentError
from grouped_gemm.mx import quantize_mx, quantize_mx_weight

BLOCK = 32
TILE_ROWS = 128
TILE_COLS = 4
#: torch: the contraction and mat_b's other dimension must be multiples of 16.
_DIM_MULTIPLE = 16


def _scaled_grouped_mm() -> Callable[..., torch.Tensor] | None:
    return getattr(torch.nn.functional, "scaled_grouped_mm", None)


_SCALED = _scaled_grouped_mm()


def swizzle_32_4_4(scale: torch.Tensor) -> torch.Tensor:
    """``(..., R, C)`` scale bytes -> ``(..., R', C')`` (R' = R rounded up to 128, C' = C
    rounded up to 4, zero padding) holding the same bytes in torch's ``SWIZZLE_32_4_4``
    order: 128 x 4 tiles, row-block-major, row r / column c of a tile at byte
    ``(r % 32) * 16 + (r // 32) * 4 + c``. Pure torch (one pad, one copy)."""
    *lead, rows, cols = scale.shape
    padded_rows = -(-rows // TILE_ROWS) * TILE_ROWS
    padded_cols = -(-cols // TILE_COLS) * TILE_COLS
    padded = torch.nn.functional.pad(scale, (0, padded_cols - cols, 0, padded_rows - rows))
    # row = 128 i + 32 j + k, column = 4 t + c  ->  tile (i, t), byte k * 16 + j * 4 + c
    tiles = padded.reshape(*lead, padded_rows // TILE_ROWS, 4, 32, padded_cols // TILE_COLS, TILE_COLS)
    n = len(lead)
    order = (*range(n), n, n + 3, n + 2, n + 1, n + 4)
    return tiles.permute(order).reshape(*lead, padded_rows, padded_cols)


def group_blocked_rows(scale: torch.Tensor, ends: torch.Tensor, total_rows: int) -> torch.Tensor:
    """The ragged 2-D operand's scales ``(M, C)``: each group's rows (``ends``: (G,) cumulative
    row ends on the device) moved to a start that is a multiple of 128 and zero-padded to a
    multiple of 128, then blocked (``swizzle_32_4_4``). ``total_rows`` is the padded row
    count (exact for host splits, or the bound ``ceil(M/128)*128 + 128*G``). No host sync."""
    device = scale.device
    sizes = torch.diff(ends.to(torch.int64), prepend=ends.new_zeros(1, dtype=torch.int64))
    padded = (sizes + TILE_ROWS - 1) // TILE_ROWS * TILE_ROWS
    padded_ends = torch.cumsum(padded, 0)
    p = torch.arange(total_rows, device=device)
    g = torch.searchsorted(padded_ends, p, right=True).clamp(max=sizes.numel() - 1)
    local = p - (padded_ends[g] - padded[g])
    valid = local < sizes[g]
    source = (ends.to(torch.int64)[g] - sizes[g] + local).clamp(0, max(scale.shape[0] - 1, 0))
    rows = scale[source] if scale.shape[0] else scale.new_zeros(total_rows, scale.shape[1])
    gathered = torch.where(valid.unsqueeze(1), rows, 0)
    return swizzle_32_4_4(gathered)


def _padded_rows(problem: Problem, inputs: GroupedInputs) -> int:
    if isinstance(inputs.m_splits, torch.Tensor):
        return -(-problem.m // TILE_ROWS) * TILE_ROWS + TILE_ROWS * problem.groups
    return sum(-(-s // TILE_ROWS) * TILE_ROWS for s in inputs.m_splits)


@functools.cache
def _probe_error(device_index: int) -> str | None:
    """Why this torch cannot run its MXFP8 grouped kernel on this GPU (None: it can)."""
    device = torch.device("cuda", device_index)
    x = torch.zeros(TILE_ROWS, 64, device=device).to(torch.float8_e4m3fn)
    w = torch.zeros(1, 16, 64, device=device).to(torch.float8_e4m3fn)
    sa = torch.full((TILE_ROWS, 64 // BLOCK), 127, dtype=torch.uint8, device=device)
    sb = torch.full((1, 16, 64 // BLOCK), 127, dtype=torch.uint8, device=device)
    offs = torch.tensor([TILE_ROWS], dtype=torch.int32, device=device)
    try:
        _call(x, w.transpose(-2, -1), group_blocked_rows(sa, offs, TILE_ROWS), _weight_scales(sb), offs)
        torch.cuda.synchronize(device)
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as exc:
        first = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {first[0] if first else ''}"
    return None


def _weight_scales(scale: torch.Tensor) -> torch.Tensor:
    """(G, rows, cols) per-group scales -> (G, rows' * cols') blocked, as torch checks."""
    blocked = swizzle_32_4_4(scale)
    return blocked.reshape(blocked.shape[0], -1)


def _call(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, offs: torch.Tensor):
    functional = torch.nn.functional
    return _SCALED(
        a,
        b,
        scale_a.view(torch.float8_e8m0fnu),
        functional.ScalingType.BlockWise1x32,
        scale_b.contiguous().view(torch.float8_e8m0fnu),
        functional.ScalingType.BlockWise1x32,
        swizzle_a=functional.SwizzleType.SWIZZLE_32_4_4,
        swizzle_b=functional.SwizzleType.SWIZZLE_32_4_4,
        offs=offs,
        output_dtype=torch.bfloat16,
    )


class TorchScaledGroupedMMBackend(Backend):
    """``F.scaled_grouped_mm`` on MXFP8 operands: fwd and dgrad (2-D x 3-D), sm_100 / sm_103."""

    spec = BackendSpec(
        name="torch_scaled_grouped_mm",
        version=f"{__version__}+torch{torch.__version__}",
        description="torch's MXFP8 grouped GEMM (F.scaled_grouped_mm, MSLK kernel): sm_100/sm_103, "
        "bf16 out, device offsets; not yet run on hardware by this project",
        ops=frozenset({"fwd", "dgrad"}),
        recipes=frozenset({"mxfp8"}),
        vendors=frozenset({"cuda"}),
        archs=("sm_100", "sm_103"),
        dtypes=frozenset({"bfloat16", "float16", "float32"}),
        out_dtypes=frozenset({"bfloat16"}),
        mx_formats=frozenset({"e4m3"}),
        n_multiple=_DIM_MULTIPLE,
        k_multiple=_DIM_MULTIPLE,
        max_groups=1024,
        host_splits=False,
        accumulate=False,
        weight_list=False,
        non_contiguous=False,
        deterministic=True,
        priority=60,
    )

    def check(self, problem: Problem) -> list[Reason]:
        if _SCALED is None:
            return [Reason("missing", f"torch {torch.__version__} has no torch.nn.functional.scaled_grouped_mm")]
        reasons = []
        contraction = ("K", problem.k) if problem.op == "fwd" else ("N", problem.n)
        if contraction[1] % BLOCK:
            reasons.append(
                Reason("align", f"{contraction[0]}={contraction[1]} (the contraction) is not a multiple of {BLOCK}")
            )
        if problem.op == "dgrad" and problem.grad_format not in (None, "e4m3"):
            reasons.append(Reason("recipe", f"grad_format {problem.grad_format}: torch's kernel takes e4m3 x e4m3"))
        if problem.capturing and problem.host_splits:
            reasons.append(Reason("capture", "m_splits are a host list the graph would keep; pass a device tensor"))
        real_gpu = problem.device.detected and problem.placement == "cuda"
        if not reasons and real_gpu and problem.device.arch in self.spec.archs:
            error = _probe_error(torch.cuda.current_device())
            if error:
                reasons.append(Reason("missing", f"torch's MXFP8 grouped kernel is unavailable here ({error})"))
        return reasons

    def run(self, problem: Problem, inputs: GroupedInputs) -> torch.Tensor:
        if problem.m == 0:
            return inputs.output(problem)
        result = _call(*operands(problem, inputs))
        return result if inputs.out is None else inputs.out.copy_(result)


def operands(
    problem: Problem, inputs: GroupedInputs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mat_a, mat_b, scale_a, scale_b, offs) as torch's kernel takes them (scales as bytes)."""
    fwd = problem.op == "fwd"
    a = _operand(problem, inputs.a, "x" if fwd else "dy", 1)
    w = _operand(problem, inputs.b, "w", 2 if fwd else 1)
    ends = inputs.offsets(a.data.device)
    scale_a = group_blocked_rows(a.scale, ends, _padded_rows(problem, inputs))
    if fwd:  # (G, N, K) row-major is (G, K, N) column-major; scales per output column N
        return a.data, w.data.transpose(-2, -1), scale_a, _weight_scales(w.scale), ends
    # dgrad, blocked along N: (G, N, K) column-major; scales per output column K
    mat_b = w.data.transpose(1, 2).contiguous().transpose(1, 2)
    return a.data, mat_b, scale_a, _weight_scales(w.scale.transpose(1, 2)), ends


def _operand(problem: Problem, t: torch.Tensor | MXTensor, name: str, axis: int) -> MXTensor:
    """An e4m3 MXTensor blocked along the contraction, no padding: as given or quantized."""
    if isinstance(t, MXTensor):
        if t.fmt != "e4m3" or t.axis != axis or t.pad or t.block_size != BLOCK:
            raise InvalidArgumentError(name, t, f"an e4m3 MXTensor with blocks of {BLOCK} along axis {axis}, no pad")
        return t
    if t.dim() == 3:
        return quantize_mx_weight(t, "e4m3", op=problem.op, scale_rule=problem.scale_rule)
    return quantize_mx(t, "e4m3", axis=axis, scale_rule=problem.scale_rule)


@hookimpl
def grouped_gemm_backends() -> list[Backend]:
    return [TorchScaledGroupedMMBackend()]
