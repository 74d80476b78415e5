"""The backend contract: a declared ``BackendSpec``, ``check`` for the rest, ``run``.

The core checks everything a spec declares (``eligibility.declared_reasons``) so every
backend's refusals read the same; ``check`` covers what a declaration cannot say.
"""

from __future__ import annotations

import abc
import dataclasses
import re
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, field_validator

from grouped_gemm.recipes import RECIPES
from grouped_gemm.vocabulary import FLOAT_DTYPE_NAMES, DTypeName

if TYPE_CHECKING:
    import torch

    from grouped_gemm.inputs import GroupedInputs
    from grouped_gemm.problem import Problem

ReasonCode = Literal[
    "op",
    "recipe",
    "dtype",
    "vendor",
    "arch",
    "placement",
    "align",
    "shape",
    "groups",
    "layout",
    "capture",
    "accumulate",
    "missing",
    "config",
    "build",
    "plugin",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Reason:
    """Why a backend cannot run a problem: a stable short ``code`` and a message that
    names the offending value and what is supported."""

    code: ReasonCode
    message: str

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


class BackendSpec(BaseModel):
    """What a backend declares it can do; the core turns each field into reasons.

    Alignments are per-group row multiples (``m_multiple``) and multiples of the
    weight's N and K; ``archs`` are fnmatch patterns (``"sm_9*"``, ``"gfx950"``), empty
    meaning every arch of ``vendors``. ``dtypes`` are the high-precision tensor dtypes
    accepted for ``a`` and ``b``; ``mx_formats`` the pre-quantized MX element formats
    accepted. ``host_splits`` means the backend reads ``m_splits`` on the host, so it
    cannot run under CUDA-graph capture and device splits cost a sync.
    ``max_padding`` is for backends that pad every group to the largest: they are
    ineligible when G times the largest group (``Problem.max_rows``, a power-of-two
    bound) exceeds ``max_padding`` x M.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    version: str = "0"
    description: str = ""
    # At least one of each: a backend declaring none could never run, and tools that probe
    # a backend with its first op and recipe (``list_backends``) would have none to take.
    ops: frozenset[Literal["fwd", "dgrad", "wgrad"]] = Field(min_length=1)
    recipes: frozenset[str] = Field(min_length=1)
    vendors: frozenset[Literal["cpu", "cuda", "rocm"]] = Field(min_length=1)
    archs: tuple[str, ...] = ()
    dtypes: frozenset[DTypeName] = frozenset(FLOAT_DTYPE_NAMES)
    out_dtypes: frozenset[DTypeName] = frozenset(FLOAT_DTYPE_NAMES)
    mx_formats: frozenset[Literal["e4m3", "e5m2", "e2m1"]] = frozenset()
    # Numbers are strict: ``priority=True`` or ``m_multiple="8"`` is a mistake, not a 1 or an 8.
    m_multiple: int = Field(default=1, ge=1, strict=True)
    n_multiple: int = Field(default=1, ge=1, strict=True)
    k_multiple: int = Field(default=1, ge=1, strict=True)
    min_k: int = Field(default=0, ge=0, strict=True)
    max_groups: int | None = Field(default=None, ge=1, strict=True)
    max_padding: float | None = Field(default=None, ge=1.0, strict=True)
    host_splits: bool = False
    accumulate: bool = True
    weight_list: bool = False
    non_contiguous: bool = True
    deterministic: bool = True
    priority: int = Field(default=0, strict=True)

    @field_validator("name")
    @classmethod
    def _name_is_identifier(cls, value: str) -> str:
        if not _NAME.fullmatch(value):  # not match: its "$" also matches before a final newline
            raise ValueError(
                f"backend name {value!r} must be lower-case letters, digits and '_', starting with a letter"
            )
        return value

    @field_validator("m_multiple")
    @classmethod
    def _m_multiple_power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"m_multiple={value} must be a power of two")
        return value

    @field_validator("recipes")
    @classmethod
    def _recipes_known(cls, value: frozenset[str]) -> frozenset[str]:
        unknown = sorted(value - set(RECIPES))
        if unknown:
            raise ValueError(f"unknown recipes {unknown}; known: {sorted(RECIPES)}")
        return value


@runtime_checkable
class BackendLike(Protocol):
    """The duck type the registry accepts (``Backend`` is a convenient base)."""

    spec: BackendSpec

    def check(self, problem: Problem) -> list[Reason]: ...

    def run(self, problem: Problem, inputs: GroupedInputs) -> Any: ...


class Backend(abc.ABC):
    """Convenience base class: subclasses set ``spec`` and implement ``run``.

    Override ``check`` for eligibility a spec cannot declare, and ``priority`` when the
    best backend depends on the problem (it is called once per problem signature). Work that
    is slow and only needed to run (compiling kernels) belongs in ``prepare``. To let
    autotuning pick kernel configs too, define ``configs(problem) -> list[dict]`` (small
    dicts of JSON scalars) and ``run_config(problem, inputs, config)`` (``grouped_gemm.autotune``).
    """

    spec: BackendSpec

    def check(self, problem: Problem) -> list[Reason]:
        """Extra reasons this backend cannot run ``problem``; empty means eligible. Reads M
        only as ``problem.m_bucket``, like ``priority``."""
        return []

    def priority(self, problem: Problem) -> int:
        """Rank among eligible backends when the user set no order; higher wins. Reads M
        only as ``problem.m_bucket``: the decision serves every M of the bucket."""
        return self.spec.priority

    def prepare(self, problem: Problem) -> list[Reason]:
        """Get ready to run ``problem`` (e.g. build kernels); reasons returned make this
        backend ineligible, like ``check``'s. Called only when this backend is about to be
        chosen, or timed by autotuning: every decision asks every backend's ``check``, so a
        slow ``check`` would cost calls that never run this backend."""
        return []

    @abc.abstractmethod
    def run(self, problem: Problem, inputs: GroupedInputs) -> torch.Tensor:
        """Compute the result of an eligible problem."""

    def __repr__(self) -> str:
        return f"<backend {self.spec.name} {self.spec.version}>"
