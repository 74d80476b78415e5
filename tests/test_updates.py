"""``gg.mark_updated``: declared writes move a tensor's write stamp; bad arguments are named."""

from __future__ import annotations

import gc

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm.updates import write_stamp


def test_declared_writes_move_the_stamp_of_each_tensor_given():
    a, b = torch.zeros(3), torch.zeros(3)
    w = gg.quantize_mx_weight(torch.randn(2, 32, 32), "e4m3")
    before = [write_stamp(t) for t in (a, b, w.data, w.scale)]
    gg.mark_updated(a, [w])
    after = [write_stamp(t) for t in (a, b, w.data, w.scale)]
    assert after[0] != before[0] and after[2] != before[2] and after[3] != before[3]
    assert after[1] == before[1]  # not named: unchanged
    a.add_(1)  # a write torch counts moves it too
    assert write_stamp(a) != after[0]


def test_a_write_declared_on_memory_moves_the_stamp_of_every_tensor_on_it():
    """Declared writes were counted per tensor object: ``mark_updated(buffer)`` left a
    parameter whose ``.data`` is a view of the buffer unmarked, and ``mark_updated(p.data)``
    marked a temporary alias of ``p``."""
    buffer, other = torch.zeros(10), torch.zeros(4)
    p = torch.nn.Parameter(torch.zeros(4))
    p.data = buffer[2:6]  # p's version counter does not see writes to buffer
    before = write_stamp(p), write_stamp(other)
    gg.mark_updated(buffer)
    assert write_stamp(p) != before[0] and write_stamp(other) == before[1]
    middle = write_stamp(p)
    gg.mark_updated(p.data)
    assert write_stamp(p) != middle and write_stamp(buffer) == write_stamp(p)


def test_a_declared_write_is_forgotten_with_its_memory():
    from grouped_gemm import updates

    t = torch.zeros(3)
    gg.mark_updated(t[1:])
    key = ("storage", t.untyped_storage()._cdata)
    assert key in updates.DECLARED
    del t
    gc.collect()
    assert key not in updates.DECLARED


def test_inference_tensors_have_a_stamp():
    with torch.inference_mode():
        t = torch.zeros(3)
    first = write_stamp(t)  # t._version raises for an inference tensor
    gg.mark_updated(t)
    assert write_stamp(t) != first


@pytest.mark.parametrize("bad", [3, "weight", None, [torch.zeros(1), 2.0]])
def test_mark_updated_names_what_it_cannot_take(bad):
    with pytest.raises(gg.InvalidTypeError, match=r"^weights\[0\](\[1\])?="):
        gg.mark_updated(bad)
