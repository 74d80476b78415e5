"""Adversarial cases from the second pass: the training path (``main_grad`` buffers of
fused wgrad accumulation), the MX quantizers, backend registration and scopes, the CLI.
Each failed before its fix; CPU only, small shapes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import grouped_gemm as gg

G, K, N = 2, 32, 8
SPLITS = [3, 5]

# ---- main_grad buffers of fuse_wgrad_accumulation --------------------------------------------

BAD_MAIN_GRADS: dict[str, Callable[[torch.nn.Parameter], torch.Tensor]] = {
    "int64": lambda w: torch.zeros(w.shape, dtype=torch.int64),
    "float64": lambda w: torch.zeros(w.shape, dtype=torch.float64),
    "transposed": lambda w: torch.zeros(G, K, N).transpose(1, 2),
    "expanded": lambda w: torch.zeros(1, N, K).expand(G, N, K),
    "the_weight_itself": lambda w: w.data,
    "a_view_of_the_weight": lambda w: w.data[:].view(w.shape),
}


@pytest.mark.parametrize("bad", list(BAD_MAIN_GRADS))
def test_a_bad_main_grad_is_named_at_forward(bad, gen):
    """A main_grad of a dtype wgrad cannot write, not contiguous, or aliasing the weight
    (wgrad would add into the weight) used to pass the forward and fail in backward as
    ``out=... is invalid`` (an argument the caller never passed), or for the alias, run
    and corrupt the weight silently. Now the forward refuses it by its name."""
    layer = gg.GroupedLinear(G, K, N, recipe="fp32", fuse_wgrad_accumulation=True)
    layer.weight.main_grad = BAD_MAIN_GRADS[bad](layer.weight)
    x = torch.randn(sum(SPLITS), K, generator=gen, requires_grad=True)
    with pytest.raises(gg.GroupedGemmError, match=r"^weight\.main_grad="):
        layer(x, SPLITS)
