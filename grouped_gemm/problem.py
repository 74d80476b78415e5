"""Problem: the immutable description of one grouped GEMM that dispatch decides on.

Every op is described with the weight's ``(N, K)``:

======  =============  ==============  ===============
op      a              b               result
======  =============  ==============  ===============
fwd     x  ``(M, K)``  w  ``(G,N,K)``  ``(M, N)``
dgrad   dy ``(M, N)``  w  ``(G,N,K)``  ``(M, K)``
wgrad   dy ``(M, N)``  x  ``(M, K)``   ``(G, N, K)``
======  =============  ==============  ===============

Decisions are cached per ``signature``: the problem with M rounded up to a power of two,
so ragged token counts that change every step reuse one decision. A backend's ``check``
and ``priority`` must therefore not depend on M beyond its bucket.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from grouped_gemm.device import DeviceInfo

Op = Literal["fwd", "dgrad", "wgrad"]
OPS: tuple[Op, ...] = ("fwd", "dgrad", "wgrad")


@dataclasses.dataclass(frozen=True, slots=True)
class Problem:
    """What a grouped GEMM call is, without its data.

    ``a_format`` / ``b_format`` are torch dtype names (``"bfloat16"``) for plain tensors
    and ``"mx_<fmt>"`` (``"mx_e2m1"``) for pre-quantized MXTensor operands.
    ``scale_rule`` and ``grad_format`` come from the recipe (the only parts of a built-in
    recipe a caller may change). ``placement`` is where the tensors are (``"cpu"`` or ``"cuda"``, which ROCm shares);
    ``device`` is the chip dispatch reasons about (possibly described, see ``use_device``).
    ``m_align`` is the largest power of two (capped at the largest alignment any
    registered backend asks for) dividing every group's row count; 0 when the splits
    live on the device and are not read. ``max_rows`` is the largest group's row count
    rounded up to a power of two (so backends that pad groups can judge their waste
    without a decision per distinct maximum); None when the splits live on the device,
    or when no registered backend declaring ``max_padding`` takes G groups (it costs a
    pass over the splits).
    ``signature`` (computed once) is the decision-cache key: every field, with M
    bucketed to a power of two.
    """

    op: Op
    recipe: str
    groups: int
    m: int
    n: int
    k: int
    a_format: str
    b_format: str
    out_dtype: str
    device: DeviceInfo
    placement: str = "cpu"
    scale_rule: str = "rceil"
    grad_format: str | None = None
    host_splits: bool = True
    weight_list: bool = False
    accumulate: bool = False
    contiguous: bool = True
    capturing: bool = False
    m_align: int = 1
    max_rows: int | None = None
    signature: tuple = dataclasses.field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        fields = tuple(getattr(self, f.name) for f in _KEY_FIELDS)
        object.__setattr__(self, "signature", fields[:3] + (m_bucket(self.m),) + fields[4:])

    @property
    def flops(self) -> int:
        """Multiply-adds counted twice: ``2 * M * N * K`` for every op."""
        return 2 * self.m * self.n * self.k

    def __str__(self) -> str:
        flags = [
            name
            for name, on in (
                ("device splits", not self.host_splits),
                ("weight list", self.weight_list),
                ("accumulate", self.accumulate),
                ("non-contiguous", not self.contiguous),
                ("capturing", self.capturing),
            )
            if on
        ]
        extra = f" ({', '.join(flags)})" if flags else ""
        return (
            f"{self.op} {self.recipe} G={self.groups} M={self.m} N={self.n} K={self.k} "
            f"[{self.a_format} x {self.b_format} -> {self.out_dtype}] "
            f"on {self.device.arch}{extra}"
        )


_KEY_FIELDS = tuple(f for f in dataclasses.fields(Problem) if f.name != "signature")


def m_bucket(m: int) -> int:
    """M rounded up to a power of two (0 stays 0)."""
    return 0 if m <= 0 else 1 << (m - 1).bit_length()


def max_rows_bucket(splits: tuple[int, ...] | list[int] | None) -> int | None:
    """``Problem.max_rows``: the largest split rounded up to a power of two (None for
    device splits, which are not read)."""
    if splits is None:
        return None
    return m_bucket(max(splits, default=0))


def m_alignment(splits: list[int] | None, cap: int) -> int:
    """``Problem.m_align``: the largest power of two <= ``cap`` dividing every split (zero
    splits divide all); 0 when the splits are on the device (``None``) and an alignment
    is asked for, since they are not read."""
    if cap <= 1:
        return 1
    if splits is None:
        return 0
    bits = 0
    for s in splits:
        bits |= s
    if bits == 0:
        return cap
    return min(bits & -bits, cap)
