"""A token-by-token float64 MoE computed from an ``ExpertParallelMoE`` state dict: the
reference the expert-parallel tests (one process or several ranks) compare against."""

from __future__ import annotations

import torch

from grouped_gemm.parallel import ACTIVATIONS


def dense_float64(state: dict[str, torch.Tensor], x: torch.Tensor, case: dict) -> torch.Tensor:
    """Every token through each of its top-k experts one at a time, from the layer's state
    (``case``: ``activation``, ``top_k``, and optionally ``normalize`` and ``bias``)."""
    gated, act = ACTIVATIONS[case["activation"]]
    ffn = state["down.weight"].shape[-1]
    probs = (x @ state["router.weight"].T).softmax(dim=-1)
    top, chosen = probs.topk(case["top_k"], dim=-1)
    if case.get("normalize", True):
        top = top / top.sum(dim=-1, keepdim=True)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=x.dtype)
        for j, e in enumerate(chosen[t].tolist()):
            h = state["gate_up.weight"][e] @ x[t] + (state["gate_up.bias"][e] if case.get("bias") else 0)
            h = act(h[:ffn]) * h[ffn:] if gated else act(h)
            acc = acc + top[t, j] * (state["down.weight"][e] @ h + (state["down.bias"][e] if case.get("bias") else 0))
        rows.append(acc)
    return torch.stack(rows)
