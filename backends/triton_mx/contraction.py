"""The contraction loop of the grouped kernels, written once for all of them.

Each kernel states what one step of its contraction does (load one slab of both operands,
multiply, accumulate) as a ``@triton.jit`` function ``step(acc, k, *tile, *config) -> acc``;
``contract`` runs it over ``k = start, start + BK, ... < stop``.

The loop has two forms, chosen by ``INTERP`` at compile time. Compiled code needs a ``for``
over ``range``: Triton's software pipeliner works on ``scf.for`` only (it is what turns the
step's loads into multi-buffered ``cp.async`` copies on sm_90), and a ``while`` would run
the loads and the MMA one after the other. Triton 3.6's interpreter cannot run that
``for`` (``range()`` over runtime bounds fails with NumPy 2: ``only 0-dimensional arrays
can be converted to Python scalars``), so there the loop is a ``while``. The step is the
same function either way.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def contract(STEP: tl.constexpr, acc, start, stop, BK: tl.constexpr, tile, config, INTERP: tl.constexpr):
    """``acc`` after ``acc = STEP(acc, k, *tile, *config)`` for ``k`` from ``start`` below
    ``stop`` by ``BK``: ``tile`` holds the step's per-tile values (pointers, masks, bounds),
    ``config`` its compile-time constants (a tuple of constexprs)."""
    if INTERP:
        k = start
        while k < stop:
            acc = STEP(acc, k, *tile, *config)
            k += BK
    else:
        for k in range(start, stop, BK):
            acc = STEP(acc, k, *tile, *config)
    return acc
