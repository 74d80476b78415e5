"""Random operands for one benchmark problem, in enough copies to defeat the L2 cache.

Data is normal random (never zeros: zeros flatter some kernels and hide wrong indexing).
Timed calls cycle through ``OperandSets.sets``; their inputs together exceed
``ROTATE_L2_FACTOR`` times the L2 cache, so no call reads operands another call left
in cache.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from grouped_gemm.bench.shapes import Case
from grouped_gemm.problem import Op

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

#: Rotated inputs add up to at least this many L2 caches.
ROTATE_L2_FACTOR = 3
#: Never more copies than this (small problems on a large L2).
MAX_SETS = 64


@dataclasses.dataclass
class Operands:
    """One call's inputs: ``a`` and ``b`` as the op takes them (see ``Problem``)."""

    a: torch.Tensor
    b: Any


@dataclasses.dataclass
class OperandSets:
    """Rotated copies of a problem's operands; ``sets[0]`` is the one checked for accuracy."""

    sets: list[Operands]
    splits: list[int]

    @property
    def first(self) -> Operands:
        return self.sets[0]


def l2_bytes(device: torch.device) -> int:
    """The device's L2 cache size (0 on the CPU, where rotation is not needed)."""
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))


def operand_shapes(op: Op, case: Case) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of ``a`` and ``b`` for an op: fwd (x, w), dgrad (dy, w), wgrad (dy, x)."""
    g, m, n, k = case.groups, case.m, case.n, case.k
    if op == "fwd":
        return (m, k), (g, n, k)
    if op == "dgrad":
        return (m, n), (g, n, k)
    return (m, n), (m, k)


def _random(shape: tuple[int, ...], std: float, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    t = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    return t.mul_(std) if std != 1.0 else t


def make_operands(
    op: Op, case: Case, splits: list[int], dtype: torch.dtype, device: torch.device, seed: int
) -> OperandSets:
    """Enough random operand copies that together they exceed the L2 (one on the CPU).

    Weights are scaled by ``1/sqrt(K)`` so results stay O(1)..O(100) for every op and
    even fp16 cannot overflow on the real shapes.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    a_shape, b_shape = operand_shapes(op, case)
    b_std = 1.0 / math.sqrt(case.k) if op != "wgrad" else 1.0
    per_set = (math.prod(a_shape) + math.prod(b_shape)) * torch.empty((), dtype=dtype).element_size()
    target = ROTATE_L2_FACTOR * l2_bytes(device)
    count = min(MAX_SETS, max(1, math.ceil(target / max(per_set, 1))))
    sets = [
        Operands(_random(a_shape, 1.0, dtype, device, gen), _random(b_shape, b_std, dtype, device, gen))
        for _ in range(count)
    ]
    return OperandSets(sets=sets, splits=list(splits))
