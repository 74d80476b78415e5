"""The fused Triton MX quantizer: amax, scale, cast and pack in one pass over the input.

Bit-identical to ``torch_quantizer``: the kernels (``triton_kernels``) apply the same
rules on integer fp32 bits and round to nearest even by one fp32 addition; on NVIDIA
sm_89+ fp8 elements use the hardware conversion of the clamped value instead (the gpu
tests compare both against torch on every fp32 exponent, sign, NaN and Inf). CUDA / ROCm
tensors run the compiled kernels; CPU tensors run them in Triton's interpreter (slow; it
is how CI checks the kernels bit for bit) when ``TRITON_INTERPRET=1`` was set before
triton was imported (Triton decides at import which of its own functions are interpreted).
"""

from __future__ import annotations

import functools

import torch
from triton.runtime.interpreter import InterpretedFunction

from grouped_gemm.errors import DeviceMismatchError
from grouped_gemm.mx import triton_kernels
from grouped_gemm.mx.formats import SCALE_RULES, MXFormat
from grouped_gemm.mx.tensor import MXTensor
from grouped_gemm.triton_launcher import CachedLauncher, cdiv, next_power_of_2

# Cached launchers (triton_launcher: host time per launch, issue 14).
_QUANTIZE_LAST = CachedLauncher(triton_kernels.quantize_last)
_QUANTIZE_STRIDED = CachedLauncher(triton_kernels.quantize_strided)


def _check_runnable(x: torch.Tensor) -> None:
    if x.device.type == "cpu" and not isinstance(triton_kernels.quantize_last, InterpretedFunction):
        raise DeviceMismatchError(
            "t",
            x,
            "a CUDA / ROCm tensor; CPU tensors run the Triton quantizer only in Triton's interpreter "
            "(TRITON_INTERPRET=1 set before triton is imported); gg.quantize_mx uses the torch one on the CPU",
        )


_RULE_IDS = {name: i for i, name in enumerate(SCALE_RULES)}


@functools.cache
def _native_fp8(device: torch.device) -> bool:
    """Whether the chip converts fp32 to OCP fp8 in hardware (NVIDIA sm_89+): its
    round-to-nearest-even conversion replaces the integer rounding for E4M3 / E5M2."""
    if device.type != "cuda" or torch.version.hip or isinstance(triton_kernels.quantize_last, InterpretedFunction):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def format_args(x: torch.Tensor, fmt: MXFormat, rule: str) -> dict[str, int]:
    return format_constants(x.dtype, x.device, fmt, rule)


def format_constants(dtype: torch.dtype, device: torch.device, fmt: MXFormat, rule: str) -> dict[str, int]:
    """The quantizer's constexprs for a source of ``dtype`` (int16: bf16 bits) on ``device``:
    from these alone, so a launch plan can work them out once."""
    return {
        "BF16_BITS": dtype == torch.int16,
        "NATIVE": fmt.bits == 8 and _native_fp8(device),
        "RULE": _RULE_IDS[rule],
        "EMAX": fmt.emax,
        "MAX_MANT": fmt.max_mantissa,
        "MBITS": fmt.mbits,
        "BIAS": fmt.bias,
        "MAX_VALUE": fmt.max_value,
        "NBITS": fmt.bits,
    }


def _pow2_at_most(n: int, cap: int) -> int:
    return min(cap, next_power_of_2(max(n, 1)))


def _launch_last(
    x: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    rows: int,
    length: int,
    padded: int,
    fmt: MXFormat,
    rule: str,
    block_size: int,
    tile: tuple[int, int, int] | None,
) -> None:
    # Default tiles: 16 blocks x 8 rows (fp8) or x 16 rows (E2M1), 4 warps: the fastest of
    # benchmarks/quantize_mx.py's sweep on an H200 for 8192 x 7168 bf16 (for E2M1 within
    # 0.5 % of the fastest, docs/mx_formats.md).
    nblocks = padded // block_size
    tile_blocks = tile[0] if tile else _pow2_at_most(nblocks, max(1, 512 // block_size))
    per_tile = 4096 if fmt.bits == 8 else 8192
    tile_rows = tile[1] if tile else _pow2_at_most(rows, max(1, per_tile // (tile_blocks * block_size)))
    warps = tile[2] if tile else 4
    col_tiles = cdiv(nblocks, tile_blocks)
    grid = (cdiv(rows, tile_rows) * col_tiles,)
    _QUANTIZE_LAST(
        grid,
        x,
        data,
        scale,
        rows,
        length,
        padded,
        col_tiles,
        BLOCK=block_size,
        TILE_ROWS=tile_rows,
        TILE_BLOCKS=tile_blocks,
        num_warps=warps,
        **format_args(x, fmt, rule),
    )


def _launch_strided(
    x: torch.Tensor,
    groups: tuple[torch.Tensor, torch.Tensor] | None,
    data: torch.Tensor,
    scale: torch.Tensor,
    outer: int,
    length: int,
    padded: int,
    inner: int,
    fmt: MXFormat,
    rule: str,
    block_size: int,
    tile: tuple[int, int, int] | None,
) -> None:
    # Default tiles, the fastest of benchmarks/quantize_mx.py's sweep on an H200 (8192 x
    # 7168 bf16, docs/mx_formats.md): 128 columns x 1 block on 1 warp (fp8), 64 x 2 on 2
    # warps (E2M1). quantize_strided puts warps on blocks, so never more warps than blocks.
    nblocks = padded // block_size
    tile_inner = tile[0] if tile else _pow2_at_most(inner, 128 if fmt.bits == 8 else 64)
    tile_blocks = tile[1] if tile else _pow2_at_most(nblocks, 1 if fmt.bits == 8 else 2)
    warps = tile[2] if tile else tile_blocks
    # Rows of a block spread over the threads a warp has left after the inner columns
    # (16 per thread); the rest of the block's rows stay in each thread's registers.
    row_threads = min(block_size // fmt.per_byte, max(1, 32 // max(1, tile_inner // 16)))
    block_tiles = cdiv(nblocks, tile_blocks)
    inner_tiles = cdiv(inner, tile_inner)
    grid = (outer * block_tiles * inner_tiles,)
    count = groups[1].numel() - 1 if groups else 0
    _QUANTIZE_STRIDED(
        grid,
        x,
        groups[0] if groups else x,
        groups[1] if groups else x,
        count,
        data,
        scale,
        length,
        padded,
        inner,
        block_tiles,
        inner_tiles,
        SEARCH_STEPS=triton_kernels.group_search_steps(count) if groups else 0,
        BLOCK=block_size,
        TILE_BLOCKS=tile_blocks,
        TILE_INNER=tile_inner,
        ROW_THREADS=row_threads,
        num_warps=warps,
        **format_args(x, fmt, rule),
    )


def _kernel_input(t: torch.Tensor) -> torch.Tensor:
    """Contiguous input; bf16 as its int16 bits (the kernels widen it themselves)."""
    x = t.contiguous()
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def _outputs(
    shape: list[int], axis: int, fmt: MXFormat, block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    data_shape = list(shape)
    data_shape[axis] //= fmt.per_byte
    scale_shape = list(shape)
    scale_shape[axis] //= block_size
    data = torch.empty(data_shape, dtype=torch.uint8, device=device)
    scale = torch.empty(scale_shape, dtype=torch.uint8, device=device)
    return data, scale


def quantize(
    t: torch.Tensor,
    fmt: MXFormat,
    axis: int,
    rule: str,
    block_size: int,
    pad: int,
    *,
    tile: tuple[int, int, int] | None = None,
) -> MXTensor:
    """Quantize validated arguments (as ``torch_quantizer.quantize``). ``tile`` overrides
    the launch shape (benchmarks): (blocks, rows, warps) along the last axis, else
    (inner, blocks, warps)."""
    _check_runnable(t)
    x = _kernel_input(t)
    shape = list(x.shape)
    length = shape[axis]
    padded_shape = list(shape)
    padded_shape[axis] = length + pad
    data, scale = _outputs(padded_shape, axis, fmt, block_size, x.device)
    if data.numel():
        outer = 1
        for s in shape[:axis]:
            outer *= s
        inner = x.numel() // max(1, outer * length) if length else 1
        if inner == 1:
            _launch_last(x, data, scale, outer, length, length + pad, fmt, rule, block_size, tile)
        else:
            _launch_strided(x, None, data, scale, outer, length, length + pad, inner, fmt, rule, block_size, tile)
    return MXTensor(
        data=data if fmt.storage == torch.uint8 else data.view(fmt.storage),
        scale=scale,
        fmt=fmt.name,
        axis=axis,
        shape=tuple(shape),
        pad=pad,
        block_size=block_size,
    )


def quantize_rows(
    t: torch.Tensor,
    starts: torch.Tensor,
    padded_starts: torch.Tensor,
    padded: int,
    fmt: MXFormat,
    rule: str,
    block_size: int,
) -> MXTensor:
    """Quantize along axis 0 the rows of a 2-D tensor regrouped without materializing them:
    group g's rows ``[starts[g], starts[g + 1])`` become rows from ``padded_starts[g]`` of a
    ``(padded, C)`` MXTensor, zeros up to ``padded_starts[g + 1]`` and past the last group.
    ``starts`` / ``padded_starts``: (G + 1,) int32 on ``t``'s device, every padded group a
    multiple of ``block_size`` rows."""
    _check_runnable(t)
    x = _kernel_input(t)
    cols = x.shape[1]
    data, scale = _outputs([padded, cols], 0, fmt, block_size, x.device)
    if data.numel():
        groups = (starts, padded_starts)
        _launch_strided(x, groups, data, scale, 1, x.shape[0], padded, cols, fmt, rule, block_size, None)
    return MXTensor(
        data=data if fmt.storage == torch.uint8 else data.view(fmt.storage),
        scale=scale,
        fmt=fmt.name,
        axis=0,
        shape=(padded, cols),
        block_size=block_size,
    )
