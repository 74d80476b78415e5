"""Adversarial cases from the thirty-sixth hunt: group sizes of ``gg.backend.gmm`` /
``gg.ops.gmm``, memory shared through distinct storages, decisions shared by a bucket of M.
Each test failed before its fix; CPU only, small shapes, fresh random data, float64
references.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import grouped_gemm as gg
from grouped_gemm import backend, ops
from grouped_gemm.testing import ref_dgrad, rel_error

# ---- batch_sizes items of gmm -------------------------------------------------------------

BAD_BATCH_ITEMS = [
    ("bool_tensor", torch.tensor(True), r"batch_sizes\[0\] is a tensor of dtype torch\.bool"),
    ("meta_tensor", torch.tensor(1, device="meta"), r"batch_sizes\[0\] is a tensor of dtype torch\.int64 .* on meta"),
]


@pytest.mark.parametrize("gmm", [backend.gmm, ops.gmm], ids=["backend.gmm", "ops.gmm"])
@pytest.mark.parametrize(("label", "item", "message"), BAD_BATCH_ITEMS, ids=[c[0] for c in BAD_BATCH_ITEMS])
def test_gmm_batch_sizes_items_are_checked_like_m_splits(gmm, label, item, message, gen):
    """gmm's host sizes went through ``operator.index`` alone: a bool tensor item counted as
    one row (gg.grouped_gemm refuses it) and a meta tensor item raised torch's bare
    "Tensor.item() cannot be called on meta tensors". Now the items are checked as
    m_splits' are, naming batch_sizes and the item."""
    a = torch.randn(6, 4, generator=gen)
    b = torch.randn(2, 4, 3, generator=gen)
    with pytest.raises(gg.SplitsError, match=rf"^batch_sizes=.*{message}"):
        gmm(a, b, [item, 5])
    good = gmm(a, b, [np.int64(1), torch.tensor(5, dtype=torch.int32)])
    assert rel_error(good, ref_dgrad(a, b, [1, 5])) < 1e-6
