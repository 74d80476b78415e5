"""Kernel launches: tile configurations, grids and the Triton call for each kernel.

Configurations are picked from shapes known on the host (M, G, N, K): never from the split
sizes, which may live on the device. ``mean rows per group`` (M / G) picks the row tile:
decode-like calls (a few tokens per expert) get 16-32-row tiles and several programs per
SM so enough weight bytes are in flight; 65-160 rows get 128 x 128 tiles and larger
groups 256 x 128 tiles (8 warps, four 32-blocks a step; E2M1 and E4M3 share the tiles).
Measured choices and their reasons: docs/notes/triton_mxfp4.md.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from grouped_gemm import Problem, Reason
from grouped_gemm.backends.triton_mx.dequant_kernel import (
    DEQUANT_TILES,
    DequantTile,
    dequant_kernel,
    quantize_decode_kernel,
    quantize_decode_rows_kernel,
)
from grouped_gemm.backends.triton_mx.grouped_kernel import grouped_kernel
from grouped_gemm.backends.triton_mx.layouts import UpcastWeight
from grouped_gemm.backends.triton_mx.scaled_kernel import block_k_for, scaled_grouped_kernel
from grouped_gemm.backends.triton_mx.schedule import max_groups_bucket
from grouped_gemm.backends.triton_mx.upcast_kernel import upcast_grouped_kernel
from grouped_gemm.backends.triton_mx.wgrad_kernel import wgrad_grouped_kernel
from grouped_gemm.errors import InvalidArgumentError
from grouped_gemm.inputs import host_sizes
from grouped_gemm.mx import MXTensor, triton_quantizer
from grouped_gemm.mx.formats import FORMATS
from grouped_gemm.mx.triton_kernels import group_search_steps
from grouped_gemm.triton_launcher import CachedLauncher, Constexprs, cdiv

# One cached launcher per kernel (grouped_gemm/triton_launcher.py: the host-time saving per launch).
_UPCAST = CachedLauncher(upcast_grouped_kernel)
_SCALED = CachedLauncher(scaled_grouped_kernel)
_QUANTIZE_DECODE = CachedLauncher(quantize_decode_kernel)
_QUANTIZE_DECODE_ROWS = CachedLauncher(quantize_decode_rows_kernel)
_DEQUANT = CachedLauncher(dequant_kernel)
_WGRAD = CachedLauncher(wgrad_grouped_kernel)
_GROUPED = CachedLauncher(grouped_kernel)


def interpreted() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(upcast_grouped_kernel, InterpretedFunction)


def placement_reasons(problem: Problem) -> list[Reason]:
    """Why the kernels cannot run where the problem's tensors live: CPU tensors need Triton's
    interpreter, and the interpreter cannot run GPU tensors."""
    interpreting = interpreted()
    if problem.placement == "cpu" and not interpreting:
        return [Reason("missing", "CPU tensors run only in Triton's interpreter; set TRITON_INTERPRET=1 before import")]
    if problem.placement != "cpu" and interpreting:
        return [Reason("missing", "TRITON_INTERPRET=1 is set: the kernels run only on CPU tensors")]
    return []


def device_splits(
    m_splits: Sequence[int] | torch.Tensor, device: torch.device, capturing: bool | None = None
) -> torch.Tensor:
    """The (G,) group sizes as a contiguous integer tensor on ``device``: device splits as
    they are (the kernels take their prefix sums themselves), host splits in one pinned copy,
    or none when a call on this stream sent the same ones lately (``host_sizes``; ``capturing``
    as ``GroupedInputs.capturing``)."""
    if isinstance(m_splits, torch.Tensor):
        if m_splits.device == device:
            return m_splits.contiguous()
        return torch.tensor(m_splits, dtype=torch.int32).to(device, non_blocking=True)
    return host_sizes(m_splits, device, torch.int32, capturing)


@functools.cache
def _units(device: torch.device) -> int:
    """SMs of a (tensor's, so indexed) CUDA device, once per device: the properties query
    is host time on every launch otherwise (issue 14)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def _persistent_programs(
    m: int, groups: int, bm: int, n_out: int, bn: int, device: torch.device, per_sm: int = 1
) -> int:
    """Programs of a persistent grouped launch: no more than the tiles the schedule can
    hold (each group may add a partial row tile), no more than ``per_sm`` per SM."""
    most_tiles = (cdiv(m, bm) + groups) * cdiv(n_out, bn)
    return max(1, min(most_tiles, _units(device) * per_sm))


@functools.cache
def _sm90_or_newer(device: torch.device) -> bool:
    """A CUDA (not ROCm) device of compute capability 9.0+, the chips of the PTX decode and
    of TMA. Once per device: the capability query is host time on every launch otherwise
    (issue 14)."""
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device) >= (9, 0)


def ptx_decode(device: torch.device) -> bool:
    """Whether the sm_90 PTX decode applies: compiled code on ``_sm90_or_newer``. Launch plans
    take it as a key (tests and probes switch it to time or check the portable decode)."""
    return not interpreted() and _sm90_or_newer(device)


@dataclasses.dataclass(frozen=True)
class UpcastConfig:
    """Tiles of the upcast kernel: rows (BM, tokens), weight rows (BN), 32-blocks per
    contraction step (2 or 4), warps, pipeline stages, programs per SM, the row height
    of a tile with at most ``small`` of its group's rows left (a small group's, or a larger
    group's last; 0: every tile is ``bm`` rows), and ``tma``:
    1 to fetch the activations through tensor descriptors where ``describable``."""

    bm: int
    bn: int
    blocks: int
    warps: int
    stages: int
    per_sm: int
    small: int = 0
    tma: int = 0

    def heights_ok(self) -> bool:
        """Whether the small-group height is off or below ``bm``."""
        return self.small < self.bm

    def smem_bytes(self, w_fmt: str = "e4m3") -> int:
        """Shared memory of the pipelined loads: ``stages`` buffers of bf16 activations and
        ``stages - 1`` of the weight words (32 bytes per row and 32-block for E4M3, 16 for
        E2M1; by default E4M3's, the upper bound for either format) and their scales, whose
        loads feed registers; and the copy barriers. What Triton 3.6, 3.7.1 and 3.9 allocate,
        to the byte but the barriers, on the tiles of benchmarks/triton_mx_compile.py."""
        word_bytes = 16 if w_fmt == "e2m1" else 32
        words = self.bn * self.blocks * word_bytes + self.bn * 4
        return self.stages * (self.bm * 32 * self.blocks * 2 + 16) + (self.stages - 1) * words

    def registers(self) -> int:
        """32-bit registers a thread holds through the loop: the fp32 accumulator and the
        weight step decoded to bf16 (wgmma's register operand)."""
        return (self.bm * self.bn + self.bn * 16 * self.blocks) // (32 * self.warps)

    def max_registers(self) -> int | None:
        """The register cap (``maxnreg``) under which ``per_sm`` programs fit an SM's 64K
        registers (a warp's are allocated 256 at a time), from three programs a SM on. At
        four stages the 16-row tile takes 160 registers a thread under Triton 3.6 but 171
        under 3.9: without the cap a third program would not fit, and a persistent grid
        sized for three runs its last third after the others have finished."""
        if self.per_sm < 3:
            return None
        return REGISTER_FILE // (self.per_sm * self.warps * 32) // 8 * 8


#: 32-bit registers of an sm_90 SM.
REGISTER_FILE = 65536


#: Names the upcast kernel's speed in the MX backends' versions, so tunings stored before the
#: coalesced weight-word load (74aabf7), one program a SM on the 256-row tile (575751b) and
#: small last tiles in two-height schedules (2026-12-07), which timed other speeds, are not
#: loaded (``tuning_store`` files by backend versions).
UPCAST_REVISION = "coalesced-1sm-tails"


def upcast_config(m: int, groups: int, w_fmt: str = "e2m1") -> UpcastConfig:
    """The default upcast configuration for a problem (see the module docstring) and its
    weight format."""
    if interpreted():
        return UpcastConfig(bm=32, bn=64, blocks=4, warps=4, stages=1, per_sm=1, tma=1)
    return _upcast_default(m, groups, w_fmt)


#: 128 x 128 tiles of one warpgroup, two programs per SM and four stages each: 250 registers
#: a thread under ptxas (the SM's whole register file for the pair), over the ``REGISTERS``
#: estimate, but compiled without spills (benchmarks/triton_mx_compile.py checks it), so it
#: is offered to E2M1's autotuning wherever it is not the default (E4M3's default until
#: its layout of word halves; two blocks a step).
TWO_PROGRAM_TILE = UpcastConfig(bm=128, bn=128, blocks=2, warps=4, stages=4, per_sm=2)


def _upcast_default(m: int, groups: int, w_fmt: str = "e2m1") -> UpcastConfig:
    config = _upcast_e2m1_default(m, groups)
    if w_fmt == "e4m3":
        # E4M3 takes E2M1's tiles (four blocks a step on every one: ``layouts_e4m3``), with
        # the stages it was measured at on the decode tiles. The decode-tile readings below
        # were taken on the H200 with the int64-word layout (2026-12-04); with today's
        # int32 halves and the coalesced (rows, 16) load the two-height tile reads the same
        # (H100, kernel alone: 347.9 us against 347.5 us at 8a85f30; docs/performance.md,
        # "The thirty-first session").
        if config.per_sm == 3:
            # E2M1's three-program 16-row tile lost to this one on E4M3 through the public
            # API (gpt-oss decode, docs/performance.md), though it won kernel alone.
            config = dataclasses.replace(config, stages=4, per_sm=2)
        elif config.small:
            # The two-height tile at three stages (dsv3 decode, E4M3): balanced 2.40x against
            # 2.27x for the 32-row tile alone (one run), skewed 1.95-2.05x against 1.92x (two);
            # at four stages, 2.34x and 1.95-1.98x.
            config = dataclasses.replace(config, stages=3)
        elif config.bm == 128:
            # 65-160 rows a group (gpt-oss gate-up), kernel alone on the H200 (2026-12-05,
            # tile_sweep, docs/performance.md "The twelfth session"): two programs a SM
            # 1.04-1.12x one program, balanced and skewed, fwd and dgrad. They do not both
            # fit the register file; the second starts as an SM frees up.
            config = dataclasses.replace(config, per_sm=2)
    return config


#: The 256 x 128 tile of two blocks a step: E2M1's until its four-block steps, E4M3's above
#: 160 rows a group until its layout of word halves; offered to E2M1's autotuning beside the
#: four-block default, which lost to it on some dgrad problems (one run).
TWO_BLOCK_TILE = UpcastConfig(bm=256, bn=128, blocks=2, warps=8, stages=4, per_sm=1)


def _upcast_e2m1_default(m: int, groups: int) -> UpcastConfig:
    mean_rows = m / max(groups, 1)
    if mean_rows <= 8:
        # Three programs a SM of three stages (registers capped, ``max_registers``), kernel
        # alone on the H200 in two runs, x the peer against two programs of four stages:
        # gpt-oss 3.39-3.47x against 3.12-3.15x (skewed 3.35x against 3.03x), qwen3
        # balanced 2.99-3.11x against 2.86-2.92x, qwen3 skewed 2.64-2.75x against 2.77-2.83x.
        return UpcastConfig(bm=16, bn=128, blocks=4, warps=4, stages=3, per_sm=3)
    if mean_rows <= 32:
        # 32-row tiles: a skewed split's large groups decode each weight tile half as often
        # (dsv3 decode, E2M1, kernel alone on the H200: skewed 2.47x the peer against 2.00x
        # with 16-row tiles; balanced 2.97x against 3.44x). Groups of at most 16 rows get
        # 16-row tiles (``small``; four stages): in two runs against the 32-row tile alone,
        # balanced 3.26-3.29x against 2.91-2.98x, skewed 2.38-2.43x against 2.50-2.52x.
        return UpcastConfig(bm=32, bn=128, blocks=4, warps=4, stages=4, per_sm=2, small=16)
    if mean_rows <= 64:
        return UpcastConfig(bm=64, bn=128, blocks=4, warps=4, stages=4, per_sm=1)
    # Compute-bound tiles: 8 warps, four 32-blocks a contraction step (since 1e409f2 the
    # E2M1 words copy in 16-byte pieces there: 328 instructions a 128-element step on the
    # 256-row tile against 2 x 216 at two blocks). Kernel alone on the H200, x the peer, one
    # run (docs/performance.md): gpt-oss gate-up (128 rows a group) 1.19x on 128 x 128 at
    # three stages against 0.91x for the one-warpgroup two-block tile; qwen3-30B gate-up
    # (256) 0.88x on 256 x 128 against 0.78x for its two-block form, dsv3 gate-up (512)
    # 0.85x against 0.68x; skewed qwen3-30B 0.79x (128 x 128: 0.83x) against 0.71x.
    if mean_rows <= 160:
        return UpcastConfig(bm=128, bn=128, blocks=4, warps=8, stages=3, per_sm=1, tma=1)
    # One program a SM on the 256-row tile. Two (its 246 registers leave room for one, so
    # the second 132 waited for SMs to free up) won 1.01-1.15x on the H200 while the weight
    # words loaded 16 bytes of 32 rows a warp copy; with the coalesced (rows, 16) load
    # (74aabf7) one program won on 70 of 72 rows of an H100 tile sweep (kernel alone,
    # prequantized weights, six compute-bound cases, balanced and skewed, fwd and dgrad):
    # E4M3 1.01-1.20x, E2M1 (a16w4, mxfp4) 1.01-1.16x, the other two within 1 %. Through
    # the public API the two read alike (geometric mean 1.00-1.01 over two A/Bs; why the
    # harnesses differ was not found): docs/performance.md, "The thirty-first session".
    return UpcastConfig(bm=256, bn=128, blocks=4, warps=8, stages=3, per_sm=1, tma=1)


_Config = TypeVar("_Config")


def _looked_up(config_fn: Callable[..., _Config]) -> Callable[..., _Config]:
    """``config_fn`` remembered per arguments and ``interpreted()`` (which tests patch): a
    launch looks its default configuration up instead of building a frozen dataclass
    (~1 us of host time on the dev CPU, issue 14). Bounded for varying M."""
    cached = functools.lru_cache(maxsize=256)(lambda interp, *args: config_fn(*args))
    return lambda *args: cached(interpreted(), *args)


@functools.lru_cache(maxsize=256)
def _upcast_plan(
    interp: bool,
    ptx: bool,
    m: int,
    groups: int,
    w_fmt: str,
    rows: int,
    k_red: int,
    small_scales: bool,
    device: torch.device,
    config: UpcastConfig | None,
    quantize: tuple[str, str] | None = None,
) -> tuple[int, Constexprs, Constexprs | None, tuple[list[int], list[int]], bool]:
    """(programs, constexprs and options, the same with the activations' TMA off where the
    tile asks for it (for an activation TMA cannot describe; else None), the activation
    blocks of the ``bm``- and ``small``-row tiles, ``fused``) of an upcast launch, worked out once per
    shape and tile and then looked up (a dozen calls and a dict otherwise: ~3.5 us of host
    time a launch on the dev CPU, issue 14). ``interp`` and ``ptx`` key on ``interpreted()``
    and ``ptx_decode``, which tests and probes switch. ``quantize`` (format, scale rule)
    goes into the constexprs where the launch quantizes the activations itself
    (``FUSED_MAX_BM``, ``FUSED_MAX_WEIGHT``); the plan's ``fused`` says whether it does."""
    cfg = config or upcast_config(m, groups, w_fmt)
    fused = quantize is not None and cfg.bm <= FUSED_MAX_BM and groups * rows * k_red <= FUSED_MAX_WEIGHT
    if w_fmt == "e4m3" and cfg.blocks != 4:
        raise InvalidArgumentError("config", cfg, "blocks=4 for E4M3 weights (its layout is read four blocks a step)")
    programs = _persistent_programs(m, groups, cfg.small or cfg.bm, rows, cfg.bn, device, cfg.per_sm)
    step = 32 * cfg.blocks
    blocks = ([cfg.bm, step], [cfg.small or cfg.bm, step])
    constexprs = Constexprs(
        BM=cfg.bm,
        SMALL=cfg.small,
        BN=cfg.bn,
        BLOCKS=cfg.blocks,
        MAX_G=max_groups_bucket(groups),
        NUM_PROGS=programs,
        EVEN_K=k_red % step == 0,
        PTX=ptx,
        FOLD=small_scales,
        W_FMT=w_fmt,
        # The compiled portable decode (tests and probes only: sm_90 takes the PTX one)
        # gave wrong sums on the H200 with TMA and four-block steps (Triton 3.6; exact
        # with pointer loads or two-block steps, cause not found): it takes pointer loads.
        TMA=bool(cfg.tma) and (ptx or interp),
        INTERP=interp,
        num_warps=cfg.warps,
        num_stages=cfg.stages,
        maxnreg=cfg.max_registers(),
        **(_activation_quantizer(quantize, device) if fused else {}),
    )
    without_tma = constexprs.replace(TMA=False) if constexprs.kwargs["TMA"] else None
    return programs, constexprs, without_tma, blocks, fused


def _activation_quantizer(quantize: tuple[str, str], device: torch.device) -> dict[str, Any]:
    """The upcast kernel's constexprs for activations it quantizes itself: the format, then
    the quantizer's for bf16 input (the kernel reinterprets the loaded bf16 as its bits)."""
    fmt, rule = quantize
    constants = triton_quantizer.format_constants(torch.int16, device, FORMATS[fmt], rule)
    del constants["BF16_BITS"]
    return {"A_FMT": fmt, **constants}


#: Where an upcast launch quantizes its activations itself (``launch_upcast``): tiles of at
#: most ``FUSED_MAX_BM`` rows, weights of at most ``FUSED_MAX_WEIGHT`` elements (G x N x K).
#: On the H100 (2026-12-06, ``benchmarks/fused_activation_probe.py``, the decode cases of
#: 0.4-2.1 G elements) the fused launch's kernel took 1.00-1.07x the two launches' time
#: for mxfp8 and 1.27-1.75x for mxfp4, while it cut the host time of a call from 53-56 to
#: 33-34 us (``host_overhead.py``): it pays only where the kernels take a few microseconds
#: (here, weights of at most 2**24 elements: about 5-10 us of weight reads at the copy rate),
#: so that the call is host-bound either way.
FUSED_MAX_BM = 32
FUSED_MAX_WEIGHT = 1 << 24


def launch_upcast(
    a: torch.Tensor,
    w: UpcastWeight,
    splits: torch.Tensor,
    out: torch.Tensor,
    groups: int,
    config: UpcastConfig | None = None,
    quantize: tuple[str, str] | None = None,
) -> torch.Tensor:
    """``out[rows of g] = a[rows of g] @ W_g^T`` with bf16 ``a`` and an upcast-layout weight;
    the activations through tensor descriptors when the config asks and ``describable(a)``.

    With ``quantize`` (format, scale rule), ``a``'s rows are first quantized per 32-block
    and decoded: the result is ``launch_upcast(quantize_decode(a, *quantize), ...)`` bit for
    bit. On small problems (``FUSED_MAX_BM``, ``FUSED_MAX_WEIGHT``) the kernel does it on the
    slabs it loads, in one launch: there the second launch is much of the call's host time
    (issue 14), and the kernel's extra work (each slab quantized once per weight column
    tile) costs a few microseconds. Elsewhere the separate pass runs first: the fused kernel
    is slower on larger weights, and the 256-row tile spills registers with it (Triton 3.6)."""
    device = a.device  # each read builds a torch.device: once per launch
    programs, constexprs, without_tma, blocks, fused = _upcast_plan(
        interpreted(),
        ptx_decode(device),
        a.shape[0],
        groups,
        w.fmt,
        w.rows,
        w.k_red,
        w.small_scales,
        device,
        config,
        quantize,
    )
    if quantize is not None and not fused:
        a = quantize_decode(a, *quantize)
    a_big = a_small = a
    if without_tma is not None:
        if describable(a):
            a_big = TensorDescriptor.from_tensor(a, blocks[0])
            a_small = a_big if blocks[1] == blocks[0] else TensorDescriptor.from_tensor(a, blocks[1])
        else:
            constexprs = without_tma
    _UPCAST.launch(
        (programs,),
        constexprs,
        a_big,
        a.stride(0),
        a_small,
        w.data,
        *w.strides[:3],
        w.scales,
        *w.strides[3:],
        out,
        out.stride(0),
        splits,
        groups,
        w.rows,
        w.k_red,
    )
    return out


@dataclasses.dataclass(frozen=True)
class GroupedConfig:
    """Tiles of the plain bf16 / fp16 grouped kernel: rows (BM), output columns (BN),
    contraction step (BK), warps, pipeline stages, programs per SM, and ``tma``: 1 to fetch
    the tiles through tensor descriptors where ``tma_runs`` allows (else pointer loads)."""

    bm: int
    bn: int
    bk: int
    warps: int
    stages: int
    per_sm: int
    tma: int = 0

    def smem_bytes(self) -> int:
        """Shared memory of the pipelined loads: both 16-bit tiles per stage."""
        return self.stages * (self.bm + self.bn) * self.bk * 2

    def registers(self) -> int:
        """32-bit registers a thread holds through the loop: the fp32 accumulator (both
        operands are read from shared memory)."""
        return self.bm * self.bn // (32 * self.warps)


def grouped_config(m: int, groups: int) -> GroupedConfig:
    """The default configuration of the plain grouped kernel: 128 x 256 x 64 tiles in 3
    stages for large groups, smaller row tiles when the mean group is small, so few-token
    experts waste fewer masked rows. H200 sweeps (docs/performance.md, 2026-12-04) found
    128 x 256 1.23-1.47x faster than 128 x 128 on the skewed qwen3-30B and gpt-oss cases,
    and 3 stages within 2 % of 4 (144 KB of shared memory: it fits sm_80's 164 KB)."""
    if interpreted():
        return GroupedConfig(bm=32, bn=32, bk=32, warps=4, stages=1, per_sm=1, tma=1)
    return _grouped_default(m, groups)


def _grouped_default(m: int, groups: int) -> GroupedConfig:
    mean_rows = m / max(groups, 1)
    if mean_rows <= 16:
        return GroupedConfig(bm=16, bn=128, bk=128, warps=4, stages=3, per_sm=2)
    if mean_rows <= 64:
        return GroupedConfig(bm=64, bn=128, bk=64, warps=4, stages=4, per_sm=2)
    return GroupedConfig(bm=128, bn=256, bk=64, warps=8, stages=3, per_sm=1, tma=1)


_grouped_config = _looked_up(grouped_config)


def describable(t: torch.Tensor) -> bool:
    """Whether a 16-bit tensor can be read through a tensor descriptor: a chip with TMA (or
    Triton's interpreter, which reads descriptors in software), a unit last stride, a
    16-byte aligned base and other strides (TMA's rules; the backends' alignment of N and K
    makes them hold for contiguous operands, a sliced one may break them), and no empty
    dimension (a descriptor's sizes are positive: N=0 weights take pointer loads)."""
    if not (interpreted() or _sm90_or_newer(t.device)) or t.element_size() != 2 or 0 in t.shape:
        return False
    *outer, last = t.stride()
    return last == 1 and t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in outer)


def tma_runs(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether both operands of the plain grouped kernel are ``describable``."""
    return describable(a) and describable(w)


def launch_grouped(
    a: torch.Tensor,
    w: torch.Tensor,
    splits: torch.Tensor,
    out: torch.Tensor,
    transpose_w: bool,
    config: GroupedConfig | None = None,
) -> torch.Tensor:
    """``out[rows of g] = a[rows of g] @ w[g]^T`` (``transpose_w``: fwd, ``w`` (G, N, K)) or
    ``@ w[g]`` (dgrad) with bf16 / fp16 ``a`` and ``w`` and unit column strides; through
    tensor descriptors when the config asks for them and ``tma_runs``."""
    m, groups = a.shape[0], w.shape[0]
    n_out, k_red = (w.shape[1], w.shape[2]) if transpose_w else (w.shape[2], w.shape[1])
    programs, cfg, constexprs, without_tma = _grouped_plan(
        interpreted(), m, groups, n_out, k_red, transpose_w, a.device, config
    )
    if without_tma is not None and not tma_runs(a, w):
        constexprs = without_tma
    if constexprs.kwargs["TMA"]:  # descriptors in place of the pointers; the operands' strides go unread then
        w_block = [1, cfg.bn, cfg.bk] if transpose_w else [1, cfg.bk, cfg.bn]
        a_arg, w_arg = TensorDescriptor.from_tensor(a, [cfg.bm, cfg.bk]), TensorDescriptor.from_tensor(w, w_block)
        strides = (0, 0, 0, 0)
    else:
        # Weight strides as (group, contraction, output column).
        stride_wc, stride_wo = (w.stride(2), w.stride(1)) if transpose_w else (w.stride(1), w.stride(2))
        a_arg, w_arg, strides = a, w, (a.stride(0), w.stride(0), stride_wc, stride_wo)
    _GROUPED.launch(
        (programs,),
        constexprs,
        a_arg,
        strides[0],
        w_arg,
        *strides[1:],
        out,
        out.stride(0),
        splits,
        groups,
        n_out,
        k_red,
    )
    return out


@functools.lru_cache(maxsize=256)
def _grouped_plan(
    interp: bool,
    m: int,
    groups: int,
    n_out: int,
    k_red: int,
    transpose_w: bool,
    device: torch.device,
    config: GroupedConfig | None,
) -> tuple[int, GroupedConfig, Constexprs, Constexprs | None]:
    """(programs, tiles, constexprs and options, the same with TMA off where the tile asks
    for it: for operands TMA cannot describe; else None) of a plain grouped launch, worked
    out once per shape and tile and then looked up, as ``_upcast_plan`` is: the launcher
    keys on one interned ``Constexprs`` instead of a dozen keywords (issue 14)."""
    cfg = config or _grouped_config(m, groups)
    programs = _persistent_programs(m, groups, cfg.bm, n_out, cfg.bn, device, cfg.per_sm)
    constexprs = Constexprs(
        BM=cfg.bm,
        BN=cfg.bn,
        BK=cfg.bk,
        MAX_G=max_groups_bucket(groups),
        NUM_PROGS=programs,
        EVEN_K=k_red % cfg.bk == 0,
        TMA=bool(cfg.tma),
        TRANSPOSE_W=bool(cfg.tma) and transpose_w,  # pointer loads get it from the strides: one compile for both ops
        INTERP=interp,
        num_warps=cfg.warps,
        num_stages=cfg.stages,
    )
    without_tma = constexprs.replace(TMA=False, TRANSPOSE_W=False) if cfg.tma else None
    return programs, cfg, constexprs, without_tma


@dataclasses.dataclass(frozen=True)
class ScaledConfig:
    """Tiles of the dot_scaled kernel (the contraction step follows K: ``block_k_for``)."""

    bm: int
    bn: int
    warps: int
    stages: int

    def smem_bytes(self) -> int:
        """Shared memory of the pipelined loads at the largest step (128) and operand
        sizes (bf16 activations, 8-bit weights), with both operands' scales."""
        return self.stages * 128 * (self.bm * 2 + self.bn + (self.bm + self.bn) // 32)

    def registers(self) -> int:
        """32-bit registers a thread holds through the loop: the fp32 accumulator and one
        128-step of bf16 activations and 8-bit weights."""
        return (self.bm * self.bn + self.bm * 64 + self.bn * 32) // (32 * self.warps)


def scaled_config(m: int, groups: int) -> ScaledConfig:
    if interpreted():
        return ScaledConfig(bm=32, bn=64, warps=4, stages=1)
    return _scaled_default(m, groups)


def _scaled_default(m: int, groups: int) -> ScaledConfig:
    mean_rows = m / max(groups, 1)
    if mean_rows <= 32:
        return ScaledConfig(bm=32, bn=128, warps=4, stages=3)
    if mean_rows <= 128:
        return ScaledConfig(bm=128, bn=128, warps=8, stages=3)
    return ScaledConfig(bm=128, bn=256, warps=8, stages=3)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


_scaled_config = _looked_up(scaled_config)


def launch_scaled(
    a: torch.Tensor | MXTensor,
    w: MXTensor,
    splits: torch.Tensor,
    out: torch.Tensor,
    groups: int,
    config: ScaledConfig | None = None,
) -> torch.Tensor:
    """``out[rows of g] = a[rows of g] @ W_g^T`` through ``tl.dot_scaled``; ``w`` is the
    E2M1 or E4M3 MXTensor quantized along the contraction (axis 2: fwd, axis 1: dgrad)."""
    if isinstance(a, MXTensor):
        a_data, a_scale, a_fmt, m = _u8(a.data), a.scale, a.fmt, a.shape[0]
        a_scale_stride = a_scale.stride(0)
    else:
        a_data, a_scale, a_fmt, m = a, a, "bf16", a.shape[0]
        a_scale_stride = 0
    fwd = w.axis == 2
    n_out = w.shape[1] if fwd else w.shape[2]
    k_red = w.shape[w.axis]
    cfg = config or _scaled_config(m, groups)
    bk = block_k_for(k_red)
    # Weight data / scale strides as (group, contraction, output column).
    wd, ws = _u8(w.data), w.scale
    w_strides = (wd.stride(0), wd.stride(2), wd.stride(1)) if fwd else (wd.stride(0), wd.stride(1), wd.stride(2))
    s_strides = (ws.stride(0), ws.stride(2), ws.stride(1)) if fwd else (ws.stride(0), ws.stride(1), ws.stride(2))
    programs = _persistent_programs(m, groups, cfg.bm, n_out, cfg.bn, out.device)
    _SCALED(
        (programs,),
        a_data,
        a_data.stride(0),
        a_scale,
        a_scale_stride,
        wd,
        *w_strides,
        ws,
        *s_strides,
        out,
        out.stride(0),
        splits,
        groups,
        n_out,
        k_red,
        BM=cfg.bm,
        BN=cfg.bn,
        BK=bk,
        A_FMT=a_fmt,
        W_FMT=w.fmt,
        MAX_G=max_groups_bucket(groups),
        NUM_PROGS=programs,
        EVEN_K=k_red % bk == 0,
        INTERP=interpreted(),
        num_warps=cfg.warps,
        num_stages=cfg.stages,
    )
    return out


def quantize_decode(x: torch.Tensor, fmt: str, scale_rule: str, tile: DequantTile | None = None) -> torch.Tensor:
    """A 2-D bf16 / fp16 / fp32 tensor quantized to ``fmt`` along its last axis and decoded
    to bf16 in one pass: bit for bit ``dequantize(gg.quantize_mx(x, fmt, axis=-1,
    scale_rule=scale_rule))`` (NaN payloads aside). ``tile`` overrides the default (the
    decode's axis-1 tile)."""
    rows, cols = x.shape
    device, dtype = x.device, x.dtype  # each read builds a Python object: once per launch
    out = torch.empty(rows, cols, dtype=torch.bfloat16, device=device)
    tile, constexprs = _quantize_decode_plan(interpreted(), ptx_decode(device), fmt, scale_rule, dtype, device, tile)
    if rows and cols:
        src = x.view(torch.int16) if dtype == torch.bfloat16 else x
        col_tiles = cdiv(cols, tile.bc)
        grid = (cdiv(rows, tile.br) * col_tiles,)
        # ``out`` is new and contiguous: its row stride is ``cols``.
        _QUANTIZE_DECODE.launch(grid, constexprs, src, src.stride(0), out, cols, rows, cols, col_tiles)
    return out


@functools.lru_cache(maxsize=64)
def _quantize_decode_plan(
    interp: bool,
    hw_e4m3: bool,
    fmt: str,
    scale_rule: str,
    dtype: torch.dtype,
    device: torch.device,
    tile: DequantTile | None,
    search_steps: int = 0,
) -> tuple[DequantTile, Constexprs]:
    """The tile and the constexprs of a ``quantize_decode`` launch (``search_steps`` 0) or a
    ``quantize_decode_rows`` one (its group search's steps; a program takes one 32-row
    block, so the axis-0 tile's columns and warps), worked out once per format, rule, dtype
    and device (issue 14: the MX recipes run them before every sm_90 GEMM); keyed like
    ``_upcast_plan`` on ``interpreted()`` and ``ptx_decode`` (``hw_e4m3``)."""
    tile = tile or (DequantTile(br=32, bc=32, warps=4) if interp else DEQUANT_TILES[0 if search_steps else 1])
    if not search_steps and tile.bc % 32:
        raise InvalidArgumentError("tile", tile, "a multiple of 32 columns (whole blocks along the last axis)")
    src_dtype = torch.int16 if dtype == torch.bfloat16 else dtype  # bf16 goes in as its bits
    quantizer = triton_quantizer.format_constants(src_dtype, device, FORMATS[fmt], scale_rule)
    shape = {"SEARCH_STEPS": search_steps} if search_steps else {"BR": tile.br}
    return tile, Constexprs(
        FMT=fmt, HW_E4M3=hw_e4m3, BC=tile.bc, INTERP=interp, num_warps=tile.warps, **shape, **quantizer
    )


def quantize_decode_rows(
    x: torch.Tensor,
    starts: torch.Tensor,
    padded_starts: torch.Tensor,
    padded_rows: int,
    fmt: str,
    scale_rule: str,
    tile: DequantTile | None = None,
) -> torch.Tensor:
    """A 2-D (M, C) bf16 / fp16 / fp32 tensor of token rows quantized to ``fmt`` along the
    tokens per group and decoded to bf16 in one pass, in the input's own rows: bit for bit
    ``gg.quantize_mx_rows(x, ...)``'s tensor decoded, its padding rows dropped (NaN payloads
    aside). ``starts`` / ``padded_starts`` / ``padded_rows``: ``gg.mx.padded_row_offsets``.
    ``tile`` overrides the default (its ``bc`` and ``warps``; a program takes 32 rows)."""
    rows, cols = x.shape
    device, dtype = x.device, x.dtype
    out = torch.empty(rows, cols, dtype=torch.bfloat16, device=device)
    groups = padded_starts.numel() - 1
    if rows and cols:
        tile, constexprs = _quantize_decode_plan(
            interpreted(), ptx_decode(device), fmt, scale_rule, dtype, device, tile, group_search_steps(groups)
        )
        src = x.contiguous()
        src = src.view(torch.int16) if dtype == torch.bfloat16 else src
        col_tiles = cdiv(cols, tile.bc)
        grid = (padded_rows // 32 * col_tiles,)
        # ``out`` is new and contiguous: its row stride is ``cols``.
        _QUANTIZE_DECODE_ROWS.launch(
            grid, constexprs, src, src.stride(0), out, cols, starts, padded_starts, groups, rows, cols, col_tiles
        )
    return out


def vendor_wgrad_runs(problem: Problem) -> bool:
    """Whether the decoded wgrad goes to ``torch._grouped_mm``: a new bf16 result on sm_90,
    compiled (not interpreted). There CUTLASS's K-grouped GEMM ran the bf16 decodes in about
    half the Triton wgrad kernel's time (H200, dsv3 gate-up: 1.28 vs 2.47 ms, 2026-12-03,
    docs/performance.md); fp32 results and accumulation stay on the Triton kernel, which
    accumulates in fp32 into ``out``."""
    return (
        problem.out_dtype == "bfloat16"
        and not problem.accumulate
        and problem.device.arch.startswith("sm_9")
        and hasattr(torch, "_grouped_mm")
        and not interpreted()
    )


def vendor_wgrad(dy: torch.Tensor, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``dw[g] = dy_g^T @ x_g`` over the group ends by ``torch._grouped_mm``, which takes
    groups of any size (as the bf16 wgrad route does); on sm_90 it writes zeros for groups
    without rows."""
    return torch._grouped_mm(dy.t(), x, offs=ends)


def dequantize(t: MXTensor, dtype: torch.dtype = torch.bfloat16, tile: DequantTile | None = None) -> torch.Tensor:
    """A 2-D MXTensor blocked along axis 0 or 1 decoded to ``dtype`` in one pass, bit for bit
    ``t.dequantize(dtype)`` (NaN payloads aside). Padding along the block axis is dropped.
    ``tile`` overrides the default (``DEQUANT_TILES``, see there; benchmarks pass others)."""
    rows, cols = t.shape
    out = torch.empty(rows, cols, dtype=dtype, device=t.device)
    tile = tile or (DequantTile(br=32, bc=32, warps=4) if interpreted() else DEQUANT_TILES[t.axis])
    if (tile.br, tile.bc)[t.axis] % 32:
        raise InvalidArgumentError("tile", tile, f"a multiple of 32 along the block axis (axis {t.axis})")
    if rows and cols:
        data = _u8(t.data)
        col_tiles = cdiv(cols, tile.bc)
        # One program per tile, 1-D: the kernel walks column tiles fastest.
        _DEQUANT(
            (cdiv(rows, tile.br) * col_tiles,),
            data,
            data.stride(0),
            t.scale,
            t.scale.stride(0),
            out,
            out.stride(0),
            rows,
            cols,
            col_tiles,
            AXIS=t.axis,
            FMT=t.fmt,
            HW_E4M3=ptx_decode(t.device),
            BR=tile.br,
            BC=tile.bc,
            INTERP=interpreted(),
            num_warps=tile.warps,
        )
    return out


@dataclasses.dataclass(frozen=True)
class WgradConfig:
    """Tiles of the wgrad kernel: output rows (BN) and columns (BK), tokens per contraction
    step (BT, a multiple of the 32-token MX blocks), warps, pipeline stages, and persistent
    programs per SM (``per_sm``: a second program can stream its ``main_grad`` tile while
    the first contracts, which matters when groups have few tokens and the fp32 epilogue
    is most of the traffic; a stored tuning without it means one)."""

    bn: int
    bk: int
    bt: int
    warps: int
    stages: int
    per_sm: int = 1

    def smem_bytes(self) -> int:
        """Shared memory of the pipelined loads: the dy and x token slabs, as bf16 decodes
        (the larger operands; MX data is 1 byte or less per element)."""
        return self.stages * self.bt * (self.bn + self.bk) * 2

    def registers(self) -> int:
        """32-bit registers a thread holds through the loop: the fp32 accumulator and the
        transposed dy slab (bf16, the register operand)."""
        return (self.bn * self.bk + self.bn * self.bt // 2) // (32 * self.warps)


def wgrad_config() -> WgradConfig:
    if interpreted():
        return WgradConfig(bn=64, bk=64, bt=64, warps=4, stages=1)
    return _WGRAD_DEFAULT


_WGRAD_DEFAULT = WgradConfig(bn=128, bk=128, bt=64, warps=8, stages=3)


_wgrad_config = _looked_up(wgrad_config)


def launch_wgrad(
    dy: torch.Tensor | MXTensor,
    x: torch.Tensor | MXTensor,
    padded_ends: torch.Tensor,
    out: torch.Tensor,
    groups: int,
    accumulate: bool,
    config: WgradConfig | None = None,
) -> torch.Tensor:
    """``out[g] (+)= dy_g^T @ x_g`` over the group ends ``padded_ends``: MX operands in the
    padded token layout (dot_scaled; dy and x may differ in format, e.g. E5M2 gradients and
    E4M3 activations), or bf16 / fp16 tensors (plain dot: their decodes, or ``triton_grouped``'s
    operands with unpadded ends)."""
    mx = isinstance(dy, MXTensor)
    dyd, xd = (_u8(dy.data), _u8(x.data)) if mx else (dy, x)
    dys, xs = (dy.scale, x.scale) if mx else (dy, x)
    n_out, k_out = out.shape[1], out.shape[2]
    cfg = config or _wgrad_config()
    tiles = groups * cdiv(n_out, cfg.bn) * cdiv(k_out, cfg.bk)
    programs = max(1, min(tiles, _units(out.device) * cfg.per_sm))
    _WGRAD(
        (programs,),
        dyd,
        dyd.stride(0),
        dys,
        dys.stride(0),
        xd,
        xd.stride(0),
        xs,
        xs.stride(0),
        out,
        out.stride(0),
        out.stride(1),
        padded_ends,
        groups,
        n_out,
        k_out,
        BN=cfg.bn,
        BK=cfg.bk,
        BT=cfg.bt,
        DY_FMT=dy.fmt if mx else "bf16",
        X_FMT=x.fmt if mx else "bf16",
        ACCUMULATE=accumulate,
        NUM_PROGS=programs,
        INTERP=interpreted(),
        num_warps=cfg.warps,
        num_stages=cfg.stages,
    )
    return out


# Candidate tiles for autotuning (the backends' ``configs`` / ``run_config`` hooks). Each
# space is the GPU default for the problem's mean rows per group plus its one-field
# neighbours, so tuning costs a few compiles and can only add to the default. The spaces
# are the GPU's whatever runs them (the interpreter ignores warps and stages), so tests run
# every candidate on the CPU.

#: Shared memory one block may use on sm_90 and sm_100 (227 KB): a candidate above it
#: cannot launch (Triton's OutOfResources), and tuning would spend its compile for nothing.
#: Each config's ``smem_bytes()`` is an upper bound: of the 96 candidates compiled for
#: ``REGISTERS``, none took more than its estimate.
SMEM_BYTES = 227 * 1024
#: Registers a thread may hold through the contraction loop (each config's ``registers()``
#: estimate), unless the default itself holds more. Calibrated on ptxas (Triton 3.9, the
#: kernels compiled on a CPU for sm_90 and sm_100 as benchmarks/triton_mx_compile.py does,
#: 2026-12-04): of the candidates estimated above 128, all but one spilled 136-520 bytes
#: a thread; at or below, the worst spilled 112 (grouped 256 x 128) and most none.
REGISTERS = 128
#: The range of each config field; tiles, blocks and warps are powers of two as well.
#: Checked on every config a tuning file or caller hands to ``parse_config``.
FIELD_RANGES = {
    "bm": (16, 256),
    "bn": (16, 256),
    "bk": (16, 256),
    "bt": (32, 256),
    "blocks": (2, 4),
    "warps": (1, 16),
    "stages": (1, 8),
    "per_sm": (1, 8),
    "small": (16, 128),
    "tma": (0, 1),
}
#: Fields that may also be 0 (off): ``small``, one row height for every group.
_MAY_BE_ZERO = frozenset({"small"})
_POWERS_OF_TWO = frozenset({"bm", "bn", "bk", "bt", "blocks", "warps", "small"})

AnyConfig = TypeVar("AnyConfig", UpcastConfig, GroupedConfig, ScaledConfig, WgradConfig)


def _in_range(name: str, value: int) -> bool:
    """Whether ``value`` is within ``FIELD_RANGES[name]``, or 0 for a field that may be off."""
    lo, hi = FIELD_RANGES[name]
    return lo <= value <= hi or (name in _MAY_BE_ZERO and value == 0)


def _fits(config: AnyConfig, default: AnyConfig, smem: Callable[[Any], int] | None = None) -> bool:
    """Within ``FIELD_RANGES`` and ``SMEM_BYTES``, within ``REGISTERS`` or the default's
    own estimate (a neighbour that only changes stages holds what it holds), with no
    register cap under ``REGISTERS`` (eight warps at three programs a SM would get 80), and
    a small-group height below ``bm``."""
    in_range = all(_in_range(f, v) for f, v in dataclasses.asdict(config).items())
    registers = max(REGISTERS, default.registers())
    cap = getattr(config, "max_registers", lambda: None)()
    heights = getattr(config, "heights_ok", lambda: True)()
    smem_bytes = smem(config) if smem else config.smem_bytes()
    fits = in_range and heights and smem_bytes <= SMEM_BYTES and config.registers() <= registers
    return fits and (cap is None or cap >= REGISTERS)


def _neighbours(
    default: AnyConfig, moves: dict[str, tuple[int, ...]], smem: Callable[[Any], int] | None = None
) -> list[AnyConfig]:
    """``default``, then each config that sets one field to one of its ``moves`` (in
    order), those that fit (``_fits``, shared memory by ``smem`` where given), without
    repeats."""
    space = [default]
    for name, values in moves.items():
        for value in values:
            config = dataclasses.replace(default, **{name: value})
            if config not in space and _fits(config, default, smem):
                space.append(config)
    return space


def grouped_configs(m: int, groups: int) -> list[GroupedConfig]:
    """The plain grouped kernel's candidates (fwd / dgrad) around its GPU default."""
    d = _grouped_default(m, groups)
    moves = {"bm": (d.bm // 2, d.bm * 2), "bn": (64, 128, 256), "bk": (32, 64, 128), "tma": (0, 1)}
    return _neighbours(d, {**moves, "stages": (3, 4), "warps": (4, 8), "per_sm": (1, 2)})


def upcast_configs(m: int, groups: int, w_fmt: str = "e2m1") -> list[UpcastConfig]:
    """The sm_90 upcast kernel's candidates (fwd / dgrad) around its GPU default for the
    weight format (E4M3: four blocks a step, as its layout is read)."""
    d = _upcast_default(m, groups, w_fmt)
    # small=64 (under 128- and 256-row tiles only, by heights_ok): skewed splits' small groups
    # and ragged last tiles, which a 256-row tile alone computes 1.05-1.69x the rows of.
    moves = {"bm": (d.bm // 2, d.bm * 2), "bn": (64, 128, 256), "blocks": (2, 4), "small": (0, 16, 64), "tma": (0, 1)}
    space = _neighbours(
        d, {**moves, "stages": (3, 4), "warps": (4, 8), "per_sm": (1, 2)}, lambda c: c.smem_bytes(w_fmt)
    )
    if d.bm >= 128 and TWO_PROGRAM_TILE not in space:
        space.append(TWO_PROGRAM_TILE)  # not one move away from the 256-row tile
    if d.bm == 256 and TWO_BLOCK_TILE not in space:
        space.append(TWO_BLOCK_TILE)  # two moves (blocks, stages) from E2M1's default
    return [c for c in space if w_fmt != "e4m3" or c.blocks == 4]


def scaled_configs(m: int, groups: int) -> list[ScaledConfig]:
    """The dot_scaled kernel's candidates (fwd / dgrad) around its GPU default."""
    d = _scaled_default(m, groups)
    return _neighbours(d, {"bm": (d.bm // 2, d.bm * 2), "bn": (64, 128, 256), "stages": (2, 3, 4), "warps": (4, 8)})


def wgrad_configs() -> list[WgradConfig]:
    """The wgrad kernel's candidates around its GPU default. Steps of 64 and 128 tokens: 32
    (one MX block, 16 bytes of packed E2M1 per row) is left out, untried on dot_scaled."""
    d = _WGRAD_DEFAULT
    moves = {"bn": (64, 128, 256), "bk": (64, 128, 256), "bt": (64, 128), "stages": (3, 4), "warps": (4, 8)}
    space = _neighbours(d, {**moves, "per_sm": (1, 2)})
    # The default holds 184-187 registers a thread (sm_90, Triton 3.6-3.9), so a second
    # program a SM only queues; the half-width tiles hold 99-120 and 72 KB of shared
    # memory, so two are resident together and one streams its fp32 tile while the other
    # contracts (the compile table holds them to that). Two moves from the default.
    for half in (dataclasses.replace(d, bn=d.bn // 2, per_sm=2), dataclasses.replace(d, bk=d.bk // 2, per_sm=2)):
        if half not in space and _fits(half, d):
            space.append(half)
    return space


def offered(problem: Problem, space: list[AnyConfig]) -> list[dict[str, int]]:
    """What a backend's ``configs(problem)`` returns: the space as dicts of its fields, or
    none for CPU tensors (Triton's interpreter, where tiles are not worth tuning time)."""
    if problem.placement == "cpu":
        return []
    return [dataclasses.asdict(c) for c in space]


def parse_config(kind: type[AnyConfig], config: Mapping[str, Any] | None) -> AnyConfig | None:
    """The ``kind`` config a dict describes (``offered``'s form), checked field by field:
    a stored tuning or a caller may hand in any dict. None stays None (the default tiles)."""
    if config is None:
        return None
    fields = dataclasses.fields(kind)
    names = [f.name for f in fields]
    required = {f.name for f in fields if f.default is dataclasses.MISSING}
    if not isinstance(config, Mapping) or not required <= set(config) or not set(config) <= set(names):
        raise InvalidArgumentError(
            "config", config, f"a {kind.__name__} dict with the keys {names} (those with defaults may be left out)"
        )
    for name, value in config.items():
        (lo, hi), pow2 = FIELD_RANGES[name], name in _POWERS_OF_TWO
        if type(value) is not int or not _in_range(name, value) or (pow2 and value & (value - 1)):
            kind_of = "a power of two" if pow2 else "an integer"
            zero = "0 or " if name in _MAY_BE_ZERO else ""
            raise InvalidArgumentError("config", config, f"{name}={value!r}: {zero}{kind_of} from {lo} to {hi}")
    parsed = kind(**config)
    if not getattr(parsed, "heights_ok", lambda: True)():
        raise InvalidArgumentError("config", config, f"small={parsed.small}: 0 or below bm={parsed.bm}")
    return parsed
