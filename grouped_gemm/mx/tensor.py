"""MXTensor: MX-quantized data, its E8M0 block scales, and which axis the blocks run along.

A quantized tensor knows its block axis: the same weight quantized along K (forward) and
along N (input gradient) are two different MXTensors, and neither is the other's
transpose. Data layout:

- ``data``: ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` with the padded shape, or for
  E2M1 ``uint8`` with the block axis halved, two elements per byte packed along the block
  axis (element ``2i`` in the low nibble, ``2i + 1`` in the high nibble: the OCP / gpt-oss
  order).
- ``scale``: ``uint8`` E8M0, the padded shape with the block axis divided by the block
  size, in the same axis position.
- ``shape``: the logical shape; ``pad`` zeros were appended along ``axis`` to reach a
  multiple of the block size.
"""

from __future__ import annotations

import dataclasses
import operator

import torch

from grouped_gemm.errors import DTypeError, InvalidArgumentError, InvalidTypeError, ShapeError
from grouped_gemm.group_offsets import visible_device
from grouped_gemm.mx.formats import BLOCK_SIZE, BLOCK_SIZES, E8M0_NAN, FORMATS, MXFormat

# E2M1 magnitudes by code (sign is bit 3): OCP MX v1.0 table 5.
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_e2m1_tables: dict[torch.device, torch.Tensor] = {}


def _e2m1_table(device: torch.device) -> torch.Tensor:
    table = _e2m1_tables.get(device)
    if table is None:
        table = _e2m1_tables[device] = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=device)
    return table


def decode_scales(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 powers of two: ``2^(b - 127)``, byte 0 is 2^-127 (an fp32
    subnormal, exact), 0xFF is NaN."""
    b = scale.to(torch.int32)
    bits = torch.where(b == 0, 0x00400000, b << 23)
    bits = torch.where(b == E8M0_NAN, 0x7FC00000, bits)
    return bits.view(torch.float32)


def unpack_e2m1(data: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 bytes ``(..., L/2)`` -> codes ``(..., L)`` (int64, low nibble first)."""
    codes = torch.stack((data & 0xF, data >> 4), dim=-1)
    return codes.reshape(*data.shape[:-1], data.shape[-1] * 2).long()


def decode_elements(data: torch.Tensor, fmt: MXFormat) -> torch.Tensor:
    """Element codes with the block axis last -> fp32 values (exact)."""
    if fmt.name == "e2m1":
        return _e2m1_table(data.device)[unpack_e2m1(data)]
    return data.to(torch.float32)


def as_block_size(block_size: object) -> int:
    """``block_size`` as a Python int: ints and numpy integers of an allowed size; bools,
    floats (``32.0``) and anything else are rejected, naming the argument."""
    if isinstance(block_size, (bool, float)):
        raise InvalidTypeError("block_size", block_size, f"an int, one of {BLOCK_SIZES} (OCP MX uses 32)")
    try:
        value = operator.index(block_size)
    except TypeError:
        raise InvalidTypeError("block_size", block_size, f"an int, one of {BLOCK_SIZES} (OCP MX uses 32)") from None
    if value not in BLOCK_SIZES:
        raise InvalidArgumentError("block_size", block_size, f"one of {BLOCK_SIZES} (OCP MX uses 32)")
    return value


def _logical_shape(shape: object) -> tuple[int, ...]:
    """``shape`` as a tuple of Python ints >= 0: a float (``4.7``) would be truncated
    silently and a non-sequence fail deep inside ``tuple()``, so both are refused here."""
    allowed = "a tuple of non-negative ints (the logical, unquantized shape)"
    if isinstance(shape, (str, bytes)):
        raise InvalidTypeError("shape", shape, allowed)
    try:
        items = list(shape)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidTypeError("shape", shape, allowed) from None
    out = []
    for s in items:
        if isinstance(s, (bool, float)):
            raise InvalidTypeError("shape", shape, allowed)
        try:
            value = operator.index(s)
        except TypeError:
            raise InvalidTypeError("shape", shape, allowed) from None
        if value < 0:
            raise ShapeError("shape", shape, allowed)
        out.append(value)
    return tuple(out)


@dataclasses.dataclass(frozen=True, eq=False)
class MXTensor:
    """A tensor quantized to an MX format along one axis (see the module docstring).

    Build one with ``gg.quantize_mx``, ``MXTensor.from_blocks`` (gpt-oss style checkpoints)
    or directly from parts; the constructor checks that the parts agree.
    """

    data: torch.Tensor
    scale: torch.Tensor
    fmt: str
    axis: int
    shape: tuple[int, ...]
    pad: int = 0
    block_size: int = BLOCK_SIZE

    def __post_init__(self) -> None:
        if not isinstance(self.data, torch.Tensor):
            raise InvalidTypeError("data", self.data, "a torch.Tensor")
        if not isinstance(self.scale, torch.Tensor):
            raise InvalidTypeError("scale", self.scale, "a uint8 torch.Tensor of E8M0 scales")
        for name, part in (("data", self.data), ("scale", self.scale)):
            if part.layout != torch.strided or part.is_nested:  # kernels and dequantize index them
                raise InvalidArgumentError(name, part, "a dense (strided, not nested) tensor")
        fmt = FORMATS.get(self.fmt) if isinstance(self.fmt, str) else None
        if fmt is None:
            raise InvalidArgumentError("fmt", self.fmt, f"one of {', '.join(FORMATS)}")
        object.__setattr__(self, "block_size", as_block_size(self.block_size))
        shape = _logical_shape(self.shape)
        object.__setattr__(self, "shape", shape)
        ndim = len(shape)
        if ndim == 0 or isinstance(self.axis, bool) or not isinstance(self.axis, int) or not -ndim <= self.axis < ndim:
            raise InvalidArgumentError("axis", self.axis, f"an int in [-{ndim}, {ndim}) for shape {shape}")
        object.__setattr__(self, "axis", self.axis % ndim)
        if isinstance(self.pad, bool) or not isinstance(self.pad, int) or not 0 <= self.pad < self.block_size:
            raise InvalidArgumentError("pad", self.pad, f"an int in [0, {self.block_size})")
        if (shape[self.axis] + self.pad) % self.block_size:
            raise ShapeError(
                "shape",
                shape,
                f"axis {self.axis} length {shape[self.axis]} + pad {self.pad} must be a multiple of {self.block_size}",
            )
        if self.data.dtype != fmt.storage:
            raise DTypeError("data", self.data, f"dtype {fmt.storage} for MX format {fmt.name}")
        if self.scale.dtype != torch.uint8:
            raise DTypeError("scale", self.scale, "dtype torch.uint8 (E8M0 scale bytes)")
        if tuple(self.data.shape) != self.data_shape:
            raise ShapeError("data", self.data, f"shape {self.data_shape} for logical shape {shape}, axis {self.axis}")
        if tuple(self.scale.shape) != self.scale_shape:
            raise ShapeError(
                "scale", self.scale, f"shape {self.scale_shape} for logical shape {shape}, axis {self.axis}"
            )
        if self.scale.device != self.data.device:
            raise InvalidArgumentError("scale", self.scale, f"a tensor on the data's device {self.data.device}")

    @property
    def format(self) -> MXFormat:
        """The element format's constants."""
        return FORMATS[self.fmt]

    @property
    def problem_format(self) -> str:
        """``"mx_<fmt>"``: how a ``Problem`` names this operand's format."""
        return FORMATS[self.fmt].problem_format

    @property
    def padded_shape(self) -> tuple[int, ...]:
        """The logical shape with the block axis padded to a multiple of the block size."""
        s = list(self.shape)
        s[self.axis] += self.pad
        return tuple(s)

    @property
    def data_shape(self) -> tuple[int, ...]:
        """The shape ``data`` must have (the padded shape; E2M1 halves the block axis)."""
        s = list(self.padded_shape)
        s[self.axis] //= FORMATS[self.fmt].per_byte
        return tuple(s)

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """The shape ``scale`` must have (the padded shape, block axis divided by the block size)."""
        s = list(self.padded_shape)
        s[self.axis] //= self.block_size
        return tuple(s)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def is_contiguous(self) -> bool:
        return self.data.is_contiguous() and self.scale.is_contiguous()

    def to(self, device: torch.device | str | int) -> MXTensor:
        """The same quantized tensor on ``device``. Only moves: ``data.to(dtype)`` would turn the
        codes into numbers (``dequantize(dtype)`` does that), so a dtype is refused here."""
        if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
            raise InvalidTypeError(
                "device", device, "a torch.device, a device name or index (for a dtype, use dequantize(dtype))"
            )
        device = visible_device(device)
        return dataclasses.replace(self, data=self.data.to(device), scale=self.scale.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The logical tensor: ``element * 2^(scale - 127)``, computed in fp32 (float64 for
        ``dtype=torch.float64``) and rounded once to ``dtype``. Blocks with scale 0xFF
        decode to NaN; padding is dropped. The fp32 product is exact except where it
        overflows: an element rounded up next to FLT_MAX can be 2^128 (Inf in fp32)."""
        if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise DTypeError("dtype", dtype, "torch.float32, torch.bfloat16, torch.float16 or torch.float64")
        fmt = FORMATS[self.fmt]
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        values = decode_elements(self.data.movedim(self.axis, -1), fmt).to(compute)
        scales = decode_scales(self.scale.movedim(self.axis, -1)).to(compute)
        blocks = values.reshape(*scales.shape, self.block_size) * scales.unsqueeze(-1)
        out = blocks.reshape(values.shape)[..., : self.shape[self.axis]]
        return out.movedim(-1, self.axis).to(dtype)

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, scales: torch.Tensor, fmt: str = "e2m1") -> MXTensor:
        """Wrap a checkpoint's block layout without copying: ``blocks (..., K/32, 32/per_byte)``
        uint8 and ``scales (..., K/32)`` uint8 -> an MXTensor of logical shape ``(..., K)``
        along the last axis (gpt-oss ships MoE weights as ``(E, N, K/32, 16)`` + ``(E, N, K/32)``).

        ``data`` is a view of ``blocks`` when it is contiguous (otherwise one copy).
        """
        f = FORMATS.get(fmt) if isinstance(fmt, str) else None
        if f is None:
            raise InvalidArgumentError("fmt", fmt, f"one of {', '.join(FORMATS)}")
        if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8:
            raise DTypeError("blocks", blocks, "a uint8 torch.Tensor of shape (..., K/32, bytes per block)")
        if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8:
            raise DTypeError("scales", scales, "a uint8 torch.Tensor of E8M0 bytes, shape (..., K/32)")
        per_block = BLOCK_SIZE // f.per_byte
        if blocks.dim() < 2 or blocks.shape[-1] != per_block:
            raise ShapeError("blocks", blocks, f"shape (..., K/32, {per_block}) for format {f.name}")
        if tuple(scales.shape) != tuple(blocks.shape[:-1]):
            raise ShapeError("scales", scales, f"shape {tuple(blocks.shape[:-1])}, blocks.shape[:-1]")
        lead = tuple(blocks.shape[:-2])
        data = blocks.reshape(*lead, blocks.shape[-2] * per_block)
        if f.storage != torch.uint8:
            data = data.view(f.storage)
        logical = (*lead, blocks.shape[-2] * BLOCK_SIZE)
        return cls(data=data, scale=scales, fmt=f.name, axis=len(logical) - 1, shape=logical)

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        """Pickle ``data`` as its bytes and rebuild through the constructor: torch cannot
        pickle float8 tensors (``UntypedStorage has no attribute 'dtype'``), and a loaded
        MXTensor gets the same checks as a new one."""
        parts = (self.data.view(torch.uint8), self.scale, self.fmt, self.axis, self.shape, self.pad, self.block_size)
        return _from_pickle, parts

    def __repr__(self) -> str:
        pad = f", pad={self.pad}" if self.pad else ""
        return (
            f"MXTensor(fmt={self.fmt}, shape={self.shape}, axis={self.axis}{pad}, "
            f"block_size={self.block_size}, device={self.device})"
        )


def _from_pickle(data: torch.Tensor, scale: torch.Tensor, fmt: str, *rest: object) -> MXTensor:
    """``MXTensor.__reduce__``'s inverse: ``data`` back from bytes to the format's storage dtype."""
    f = FORMATS.get(fmt) if isinstance(fmt, str) else None
    if f is not None and isinstance(data, torch.Tensor) and data.dtype == torch.uint8:
        data = data.view(f.storage)
    return MXTensor(data, scale, fmt, *rest)  # type: ignore[arg-type]


# torch.load's default (weights_only) unpickler calls only allowlisted functions.
torch.serialization.add_safe_globals([_from_pickle])
