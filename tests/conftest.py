"""Shared fixtures: seeded generators, GPU detection, a clean dispatcher per test."""

from __future__ import annotations

import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    # Without a GPU, Triton kernels run in Triton's CPU interpreter. The flag is read when
    # kernels are decorated, so it is set before grouped_gemm (and its backends) import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import grouped_gemm as gg  # noqa: E402 - must follow the interpreter switch above


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU; none is visible to torch")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clean_state():
    """Every test starts from the environment's settings and fresh statistics."""
    gg.reset_config()
    gg.reset_dispatch_stats()
    yield
    gg.reset_config()


@pytest.fixture
def gen() -> torch.Generator:
    """A CPU generator with a fixed seed, so failures reproduce."""
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def gpu_device() -> torch.device:
    return torch.device("cuda")


class FakeBackend(gg.Backend):
    """A backend for dispatch tests: computes with torch per group and records its calls."""

    def __init__(self, spec: gg.BackendSpec, reasons: list[gg.Reason] | None = None) -> None:
        self.spec = spec
        self.reasons = reasons or []
        self.checks = 0
        self.runs = 0

    def check(self, problem: gg.Problem) -> list[gg.Reason]:
        self.checks += 1
        return list(self.reasons)

    def run(self, problem: gg.Problem, inputs: gg.GroupedInputs) -> torch.Tensor:
        self.runs += 1
        splits = inputs.splits_list()
        w = inputs.b
        out = inputs.out if inputs.out is not None else torch.empty(problem.m, problem.n, dtype=inputs.a.dtype)
        start = 0
        for g, rows in enumerate(splits):
            out[start : start + rows] = inputs.a[start : start + rows] @ w[g].T
            start += rows
        return out


@pytest.fixture
def register():
    """``register(backend)``: registers ``backend`` for this test and returns it; every
    backend registered this way is unregistered when the test ends, pass or fail."""
    names: list[str] = []

    def add(backend: gg.Backend) -> gg.Backend:
        gg.register_backend(backend)
        names.append(backend.spec.name)
        return backend

    yield add
    for name in reversed(names):
        gg.unregister_backend(name)


@pytest.fixture
def make_backend(register):
    """Register fake fwd backends for one test: ``make_backend("a", priority=5, ...)``."""

    def make(name: str, *, reasons: list[gg.Reason] | None = None, **fields) -> FakeBackend:
        defaults = dict(
            name=name,
            ops=frozenset({"fwd"}),
            recipes=frozenset({"fp32", "bf16"}),
            vendors=frozenset({"cpu", "cuda", "rocm"}),
        )
        return register(FakeBackend(gg.BackendSpec(**{**defaults, **fields}), reasons))

    return make
