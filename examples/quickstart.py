"""Quickstart: grouped GEMMs for an MoE layer, the routing decision, a fallback warning.

Runs anywhere: on a CPU ``torch_grouped_mm`` does the work, except the wgrad into an fp32
``main_grad`` (it writes only its inputs' dtype), which runs on the ``padded_bmm`` plugin when
installed, else on ``reference``; on a GPU the fast backends do.
python examples/quickstart.py
"""

from __future__ import annotations

import torch

import grouped_gemm as gg
from grouped_gemm.testing import ref_dgrad, ref_fwd, ref_wgrad, rel_error

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
dtype = torch.bfloat16
experts, hidden, ffn, tokens = 8, 256, 512, 2048

# Token counts per expert change every step, are skewed, and can be zero.
splits = gg.skewed_splits(experts, tokens, seed=3)
splits[0] += splits[5]
splits[5] = 0

x = torch.randn(tokens, hidden, device=device, dtype=dtype)
w = (torch.randn(experts, ffn, hidden, device=device) * hidden**-0.5).to(dtype)
dy = torch.randn(tokens, ffn, device=device, dtype=dtype)

out = gg.grouped_gemm(x, w, splits)  # out_g = x_g @ w_g.T   (tokens, ffn)
dx = gg.grouped_gemm_dgrad(dy, w, splits)  # dx_g = dy_g @ w_g      (tokens, hidden)
main_grad = torch.zeros(experts, ffn, hidden, device=device)  # fp32, as in Megatron
gg.grouped_gemm_wgrad(dy, x, splits, out=main_grad, accumulate=True)  # dw_g += dy_g.T @ x_g

print(f"splits per expert: {splits}")
print(f"fwd   rel. error vs float64: {rel_error(out, ref_fwd(x, w, splits)):.2e}")
print(f"dgrad rel. error vs float64: {rel_error(dx, ref_dgrad(dy, w, splits)):.2e}")
print(f"wgrad rel. error vs float64: {rel_error(main_grad, ref_wgrad(dy, x, splits)):.2e}")

print("\nWhich backend ran the forward, and why not the others:")
decision = gg.explain(x, w, splits)
print(decision.table())

# Ask for a backend that cannot run this call: the call still works, on the next best
# backend, and with fallback warnings on, a FallbackWarning says what was skipped and why.
unusable = next((c.name for c in decision.candidates if not c.eligible), None)
if unusable is not None:
    print(f"\nPreferring '{unusable}', which cannot run this call, with fallback warnings on:")
    gg.configure(warn_fallback=True)
    with gg.use_backends([unusable]):
        gg.grouped_gemm(x, w, splits)
else:
    print("\nEvery registered backend can run this call here, so there is no fallback to show.")

print(f"\ndispatch_stats: {gg.dispatch_stats()}")
