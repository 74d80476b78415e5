"""Group ends for the kernels (``GroupedInputs.offsets``): values and the work they cost."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import grouped_gemm as gg

SPLIT_CASES = [[5], [0, 0, 7], [3, 0, 9, 0, 1], [0], [16, 16, 16, 16]]


class _OpLog(TorchDispatchMode):
    """Records every aten op run while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def _reference(splits: list[int]) -> list[int]:
    return list(itertools.accumulate(splits))


@pytest.mark.parametrize("splits", SPLIT_CASES)
@pytest.mark.parametrize("form", ["host", "int32", "int64"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_offsets_equal_reference(splits, form, dtype):
    given = splits if form == "host" else torch.tensor(splits, dtype=getattr(torch, form))
    ends = gg.GroupedInputs(None, None, given).offsets(torch.device("cpu"), dtype)
    assert ends.dtype == dtype and ends.device.type == "cpu"
    assert ends.tolist() == _reference(splits)


@pytest.mark.parametrize("split_dtype", [torch.int32, torch.int64])
def test_device_splits_cost_one_op_and_are_cached(split_dtype):
    """One cumsum straight into int32 (no widening, no separate conversion), once per call."""
    inputs = gg.GroupedInputs(None, None, torch.tensor([4, 0, 2**20], dtype=split_dtype))
    with _OpLog() as log:
        first = inputs.offsets(torch.device("cpu"))
        again = inputs.offsets(torch.device("cpu"))
    assert log.ops == ["cumsum"]
    assert again is first and first.tolist() == [4, 4, 4 + 2**20]


def test_host_splits_build_ends_in_python():
    """Host splits: the ends are summed on the host and become one tensor (no device op)."""
    inputs = gg.GroupedInputs(None, None, (7, 0, 3))
    with _OpLog() as log:
        ends = inputs.offsets(torch.device("cpu"))
    assert "cumsum" not in log.ops and ends.tolist() == [7, 7, 10] and ends.dtype == torch.int32


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["host", "int32", "int64"])
def test_offsets_on_gpu_without_sync(form):
    splits = [3, 0, 9, 0, 1]
    device = torch.device("cuda")
    given = splits if form == "host" else torch.tensor(splits, dtype=getattr(torch, form), device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ends = gg.GroupedInputs(None, None, given).offsets(device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ends.dtype == torch.int32 and ends.device == device
    assert ends.cpu().tolist() == _reference(splits)
