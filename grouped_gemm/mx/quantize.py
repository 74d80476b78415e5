"""``quantize_mx``: argument checks, then the torch quantizer (CPU) or the Triton one (GPU)."""

from __future__ import annotations

import torch

from grouped_gemm.errors import DTypeError, InvalidArgumentError, InvalidTypeError, ShapeError
from grouped_gemm.mx import torch_quantizer
from grouped_gemm.mx.formats import BLOCK_SIZE, FORMATS, INPUT_DTYPES, SCALE_RULES, MXFormat
from grouped_gemm.mx.tensor import MXTensor, as_block_size


def scale_rule_name(scale_rule: object) -> str:
    """The scale rule's canonical (lower-case) name; the docs write them FLOOR / RCEIL / EVEN."""
    name = scale_rule.lower() if isinstance(scale_rule, str) else None
    if name not in SCALE_RULES:
        raise InvalidArgumentError("scale_rule", scale_rule, f"one of {', '.join(SCALE_RULES)} (any case)")
    return name


def check_args(
    t: object, fmt: object, axis: object, scale_rule: object, block_size: object, pad: object, argument: str = "t"
) -> tuple[MXFormat, int, int]:
    """(format, non-negative axis, zeros to append) for valid arguments, else a clear error
    naming the tensor as the caller's ``argument``."""
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(argument, t, "a torch.Tensor")
    if t.layout != torch.strided or t.is_nested:  # the quantizers reshape and index t
        raise InvalidArgumentError(argument, t, "a dense (strided, not nested) tensor; call .to_dense()")
    if t.dtype not in INPUT_DTYPES:
        raise DTypeError(argument, t, "dtype torch.float32, torch.bfloat16 or torch.float16")
    f = FORMATS.get(fmt) if isinstance(fmt, str) else None
    if f is None:
        raise InvalidArgumentError("fmt", fmt, f"one of {', '.join(FORMATS)}")
    scale_rule_name(scale_rule)
    block_size = as_block_size(block_size)
    if not isinstance(pad, bool):
        raise InvalidTypeError("pad", pad, "True or False")
    ndim = t.dim()
    if ndim == 0:
        raise ShapeError(argument, t, "a tensor with at least one dimension (the block axis)")
    if isinstance(axis, bool) or not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise InvalidArgumentError("axis", axis, f"an int in [-{ndim}, {ndim}) for a {ndim}-D tensor")
    axis %= ndim
    length = t.shape[axis]
    missing = -length % block_size
    if missing and not pad:
        raise ShapeError(
            argument,
            t,
            f"axis {axis} length {length} must be a multiple of block_size={block_size} (or pass pad=True to "
            "append zeros)",
        )
    return f, axis, missing


def quantize_mx(
    t: torch.Tensor,
    fmt: str,
    *,
    axis: int = -1,
    scale_rule: str = "rceil",
    block_size: int = BLOCK_SIZE,
    pad: bool = False,
) -> MXTensor:
    """Quantize ``t`` (fp32 / bf16 / fp16, any leading dims) to MX format ``fmt`` in blocks
    of ``block_size`` along ``axis``.

    ``fmt`` is ``"e4m3"``, ``"e5m2"`` or ``"e2m1"``; ``scale_rule`` picks the E8M0 scale:

    - ``"rceil"`` (default, NVIDIA's rule): the smallest power of two >= ``amax / max_elem``
      (max_elem 448, 57344, 6), the quotient taken in fp32; quotients <= 2^-127 give byte 0.
    - ``"floor"`` (OCP MX v1.0): ``2^(floor(log2(amax)) - emax_elem)`` (emax_elem 8, 15, 2),
      exponent clamped to [-127, 127].
    - ``"even"`` (AMD Quark): amax rounded to mantissa-bits + 1 significant bits, ties up,
      then ``floor``.

    Elements are ``x / scale`` (an exact power-of-two multiply) rounded to nearest even and
    saturated to ±max_elem. A zero block gets scale byte 0 and zero elements; a block
    holding NaN or Inf gets scale byte 0xFF (NaN on decode) and zero elements. The block
    axis length must be a multiple of ``block_size`` unless ``pad=True``, which appends
    zeros (recorded in ``MXTensor.pad``). CUDA / ROCm tensors use a fused Triton kernel,
    bit-identical to the torch implementation used on the CPU. See docs/mx_formats.md.
    """
    block_size = as_block_size(block_size)
    f, axis, missing = check_args(t, fmt, axis, scale_rule, block_size, pad)
    return quantize_checked(t, f, axis, scale_rule_name(scale_rule), block_size, missing)


def quantize_checked(t: torch.Tensor, f: MXFormat, axis: int, rule: str, block_size: int, missing: int) -> MXTensor:
    """``quantize_mx`` after ``check_args``: for callers that checked the arguments under
    their own names (``quantize_mx_weight``'s ``w``), so they are not checked twice.

    A lazily negated view (``z.conj().imag``) is resolved first: the torch quantizer's
    bit view of it raised, and the Triton one reads the memory without the sign."""
    t = t.resolve_neg()
    if t.device.type == "cuda":  # CUDA and ROCm
        from grouped_gemm.mx import triton_quantizer  # imports Triton only when a GPU needs it

        return triton_quantizer.quantize(t, f, axis, rule, block_size, missing)
    return torch_quantizer.quantize(t, f, axis, rule, block_size, missing)
