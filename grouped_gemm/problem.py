"""Problem: the immutable description of one grouped GEMM that dispatch decides on.

Every op is described with the weight's ``(N, K)``:

======  =============  ==============  ===============
op      a              b               result
======  =============  ==============  ===============
fwd     x  ``(M, K)``  w  ``(G,N,K)``  ``(M, N)``
dgrad   dy ``(M, N)``  w  ``(G,N,K)``  ``(M, K)``
wgrad   dy ``(M, N)``  x  ``(M, K)``   ``(G, N, K)``
======  =============  ==============  ===============

Decisions are made per ``signature``: the problem with M rounded up to a power of two
(the dispatch cache buckets M the same way), so ragged token counts that change every step
reuse one decision. A backend's ``check``
and ``priority`` must therefore not depend on M beyond its bucket: they read ``m_bucket``.

``build_problem`` is the one way a Problem is made, for a real call (``validation``) and a
described one (``describe_problem``) alike, so the two cannot disagree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import torch

from grouped_gemm.device import DeviceInfo
from grouped_gemm.recipes import Recipe
from grouped_gemm.vocabulary import FLOAT_DTYPES

Op = Literal["fwd", "dgrad", "wgrad"]
OPS: tuple[Op, ...] = ("fwd", "dgrad", "wgrad")


@dataclasses.dataclass(frozen=True, slots=True)
class Problem:
    """What a grouped GEMM call is, without its data.

    ``a_format`` / ``b_format`` are torch dtype names (``"bfloat16"``) for plain tensors
    and ``"mx_<fmt>"`` (``"mx_e2m1"``) for pre-quantized MXTensor operands.
    ``scale_rule`` and ``grad_format`` come from the recipe (the only parts of a built-in
    recipe a caller may change). ``placement`` is where the tensors are (``"cpu"`` or ``"cuda"``, which ROCm shares);
    ``device`` is the chip: the one under the tensors for a real call, the described one
    for ``describe_problem`` / ``explain`` without tensors (see ``use_device``).
    ``m_align`` is the largest power of two (capped at the largest alignment any
    registered backend asks for) dividing every group's row count; 0 when the splits
    live on the device and are not read. ``max_rows`` is the largest group's row count
    rounded up to a power of two: backends that pad groups judge their waste by it, and
    with M it tells a skewed split from a balanced one (autotuning keys on both), without
    a decision per distinct maximum; None when the splits live on the device.
    ``signature`` (computed once) names the decision: every field, with M bucketed to a
    power of two (fallback warnings and autotuning records are per signature).
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
    #: The result's shape: fwd ``(M, N)``, dgrad ``(M, K)``, wgrad ``(G, N, K)``.
    out_shape: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False, hash=False)
    #: ``out_dtype`` as a torch dtype (None for a name no call makes).
    out_torch_dtype: torch.dtype | None = dataclasses.field(init=False, repr=False, compare=False, hash=False)
    #: M rounded up to a power of two: all of M that ``check`` and ``priority`` may read,
    #: since one decision serves every M of the bucket (the call that filled the cache
    #: must not decide the route of the next).
    m_bucket: int = dataclasses.field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        # Computed once: every call checks its result against both (issue 14's host time).
        fields = tuple(getattr(self, f.name) for f in _KEY_FIELDS)
        bucket = m_bucket(self.m)
        object.__setattr__(self, "m_bucket", bucket)
        object.__setattr__(self, "signature", fields[:3] + (bucket,) + fields[4:])
        if self.op == "fwd":
            shape: tuple[int, ...] = (self.m, self.n)
        elif self.op == "dgrad":
            shape = (self.m, self.k)
        else:
            shape = (self.groups, self.n, self.k)
        object.__setattr__(self, "out_shape", shape)
        object.__setattr__(self, "out_torch_dtype", FLOAT_DTYPES.get(self.out_dtype))

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


_KEY_FIELDS = tuple(f for f in dataclasses.fields(Problem) if f.init)


def build_problem(
    *,
    op: Op,
    recipe: Recipe,
    groups: int,
    m: int,
    n: int,
    k: int,
    a_format: str,
    b_format: str,
    out_dtype: str,
    device: DeviceInfo,
    placement: str,
    splits: Sequence[int] | None,
    m_align_cap: int,
    weight_list: bool,
    accumulate: bool,
    contiguous: bool,
    capturing: bool,
) -> Problem:
    """The Problem of a call, real or described: every field from its source, none by default.

    ``recipe`` is resolved (its name, scale rule and gradient format go in); ``splits`` are
    the group sizes when they are on the host, None when they live on the device (never
    read). ``m_align_cap`` is the registry's ``Registry.max_m_multiple``: see ``split_facts``.
    """
    m_align, max_rows = split_facts(splits, m_align_cap=m_align_cap)
    return Problem(
        op=op,
        recipe=recipe.name,
        groups=groups,
        m=m,
        n=n,
        k=k,
        a_format=a_format,
        b_format=b_format,
        out_dtype=out_dtype,
        device=device,
        placement=placement,
        scale_rule=recipe.scale_rule,
        grad_format=recipe.grad_format,
        host_splits=splits is not None,
        weight_list=weight_list,
        accumulate=accumulate,
        contiguous=contiguous,
        capturing=capturing,
        m_align=m_align,
        max_rows=max_rows,
    )


#: ``split_facts`` of recent host splits: a MoE layer's GEMMs (three forward, up to six
#: backward) share one list of group sizes, and the pass over it costs about 4 us of host
#: time at 128 groups on the dev CPU. Bounded: cleared when full; tuples of at most
#: ``_RECENT_FACTS_GROUPS`` sizes only.
_RECENT_FACTS: dict[tuple[tuple[int, ...], int], tuple[int, int | None]] = {}
_RECENT_FACTS_MAX = 64
_RECENT_FACTS_GROUPS = 4096


def split_facts(splits: Sequence[int] | None, *, m_align_cap: int) -> tuple[int, int | None]:
    """``(m_align, max_rows)`` of host ``splits`` (None: device splits).

    ``m_align`` is capped at ``m_align_cap``, the largest row multiple a registered backend
    asks for (1: no pass over the splits for it). Runs on every call: a tuple of sizes seen
    lately is looked up, not walked again.
    """
    if splits is None:
        return (0 if m_align_cap > 1 else 1), None
    if type(splits) is tuple and len(splits) <= _RECENT_FACTS_GROUPS:
        key = (splits, m_align_cap)
        facts = _RECENT_FACTS.get(key)
        if facts is None:
            if len(_RECENT_FACTS) >= _RECENT_FACTS_MAX:
                _RECENT_FACTS.clear()
            facts = _RECENT_FACTS[key] = _walked_facts(splits, m_align_cap)
        return facts
    return _walked_facts(splits, m_align_cap)


def _walked_facts(splits: Sequence[int], m_align_cap: int) -> tuple[int, int | None]:
    """``split_facts`` by one pass over ``splits``."""
    if m_align_cap <= 1:
        m_align = 1
    else:
        bits = 0
        for s in splits:
            bits |= s
        m_align = m_align_cap if bits == 0 else min(bits & -bits, m_align_cap)
    top = max(splits, default=0)
    return m_align, 0 if top <= 0 else 1 << (top - 1).bit_length()


def m_bucket(m: int) -> int:
    """M rounded up to a power of two (0 stays 0)."""
    return 0 if m <= 0 else 1 << (m - 1).bit_length()
