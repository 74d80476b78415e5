"""Shared fixtures: seeded generators, GPU detection, a clean dispatcher per test."""

from __future__ import annotations

import pytest
import torch

import grouped_gemm as gg

HAS_GPU = torch.cuda.is_available()


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
