"""The Hopper upcast kernel's layout of an E4M3 weight (``triton_mxfp8``), beside the E2M1 one.

Same ``UpcastWeight`` as ``layouts.build_upcast_weight`` (rows x contraction per group,
contraction zero-padded to 128, scales (G, Kp/128, rows) int32, run-major words), with
``fmt="e4m3"`` and ``data`` (G, rows, Kp/128, 32) int32: an E4M3 element is a byte, so the
eight elements one thread holds of a 32-block in wgmma's register fragment (elements
``32b + 8j + 2q + h``, j in 0..3, h in 0..1, for ``q = lane % 4``) fill two int32 words,
the low one j = 0, 1 and the high one j = 2, 3, element ``8j + 2q + h`` at byte
``2 (j % 2) + h``. The low words of a run come first, as E2M1's words lie (word ``4q + b``),
and the high words 16 words on (``word_index``): a thread's low words of the four blocks
of a run are one 16-byte piece and its high words another, the shape in which E2M1's words
load, so the kernel decodes E4M3 four blocks a step on every tile as E2M1 does (int64 words,
this layout until 2026-12-04, could not keep the wgmma layout on 8-warp tiles at four
blocks). Keeping the halves apart makes each of the two loads read whole 32-byte sectors
(the first and the last 64 bytes of a row's run); with a thread's low and high pieces side
by side (``8q + 4 (j // 2) + b``, until 2026-12-06) each load read half of every sector of
the run. Only the word positions differ from E2M1: the decode is
``decode.e4m3_words_to_bf16``.

NaN codes (0x7F, 0xFF): the sm_90 decode has no select for them, so the builder gives every
32-block holding one the NaN scale byte 0xFF. A GEMM output element that reads a NaN
weight element is NaN either way (x * NaN is NaN for every x), so results are unchanged.

``small_scales``: every scale byte is at most 134, so the decode's 2^120 folds into the
scale (2^(e - 7) is a normal bf16) and one multiply does.
"""

from __future__ import annotations

import torch

from grouped_gemm.backends.triton_mx.layouts import K_ALIGN, UpcastWeight, upcast_weight
from grouped_gemm.backends.triton_mx.weight_prep_kernel import E4M3_HIGH_WORDS
from grouped_gemm.mx import MXTensor
from grouped_gemm.torch_device import capturing_on

#: Words from a low word of a run to its high word (the module docstring says why).
HIGH_WORDS: int = E4M3_HIGH_WORDS.value


def word_index(q: int, b: int, high: int) -> int:
    """The int32 word of a 128-run that holds thread-quad position ``q``'s elements j = 0, 1
    (``high`` 0) or j = 2, 3 (``high`` 1) of 32-block ``b`` (the module docstring says why
    this order)."""
    return 4 * q + b + HIGH_WORDS * high


#: Names this layout in the backend's version, so tunings stored for earlier layouts (the
#: int64 words, whose two-block tiles this one cannot run; the side-by-side halves, timed
#: at other speeds) are not loaded.
LAYOUT = "e4m3-halves-apart"
#: Largest scale byte whose folded multiplier 2^(e - 7) is a finite bf16.
FOLD_MAX_SCALE = 134
NAN_SCALE = 255


def build_upcast_weight_e4m3(mx: MXTensor, check_scales: bool = False) -> UpcastWeight:
    """The upcast layout of a (G, N, K) E4M3 weight quantized along K (fwd) or N (dgrad);
    ``check_scales`` finds out ``small_scales`` (one device-to-host read)."""
    codes, scale = mx.data.view(torch.uint8), mx.scale
    if mx.axis == 1:  # dgrad: rows are K, the contraction is N
        codes, scale = codes.transpose(1, 2), scale.transpose(1, 2)
    groups, rows, k_red = codes.shape
    k_padded = -(-k_red // K_ALIGN) * K_ALIGN
    runs = k_padded // K_ALIGN
    nan_blocks = ((codes & 0x7F) == 0x7F).reshape(groups, rows, k_red // 32, 32).any(-1)
    scale = torch.where(nan_blocks, torch.full_like(scale, NAN_SCALE), scale)
    codes = torch.nn.functional.pad(codes, (0, k_padded - k_red))
    # Element 32b + 8j + 2q + h of each 128-run (j = 2 * jh + jl) -> int32 word
    # 16 jh + 4q + b, byte 2 jl + h; run-major.
    split = codes.reshape(groups, rows, runs, 4, 2, 2, 4, 2)  # g, row, run, b, jh, jl, q, h
    ordered = split.permute(0, 2, 1, 4, 6, 3, 5, 7).contiguous()  # g, run, row, jh, q, b, jl, h
    data = ordered.reshape(groups, runs, rows, 32, 4).view(torch.int32).reshape(groups, runs, rows, 32).transpose(1, 2)
    blocks = torch.nn.functional.pad(scale, (0, (k_padded - k_red) // 32)).contiguous()
    scales = blocks.view(torch.int32).transpose(1, 2).contiguous()
    small = check_scales and not capturing_on(mx.device) and bool((scale <= FOLD_MAX_SCALE).all())
    return UpcastWeight(
        data=data, scales=scales, rows=rows, k_red=k_red, k_padded=k_padded, small_scales=small, fmt="e4m3"
    )


def upcast_weight_e4m3(mx: MXTensor) -> UpcastWeight:
    """``build_upcast_weight_e4m3(mx, check_scales=True)``, cached per MXTensor object and
    tensor version (``layouts.upcast_weight``'s cache)."""
    return upcast_weight(mx, build_upcast_weight_e4m3)
