"""A small mixture-of-experts block on GroupedLinear, trained for a few steps.

Router -> top-k -> permute tokens by expert -> GroupedLinear gate-up -> SwiGLU ->
GroupedLinear down -> unpermute (weighted by the router). The student block learns to
match a fixed random teacher block on one batch of tokens; the loss printed falls. At the end it
prints which backends ran each grouped GEMM (``gg.dispatch_stats()``): on a CPU
``torch_grouped_mm`` (priority 5 there, above the ``padded_bmm`` plugin's 2), the fast
backends on a GPU.

    python examples/moe_layer.py                  # CPU: bf16, a few seconds
    python examples/moe_layer.py --device cuda    # GPU: the same, on the fast backends
    python examples/moe_layer.py --compile        # torch.compile(fullgraph=True)
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import grouped_gemm as gg


class MoEBlock(torch.nn.Module):
    """Top-k routed experts. Per-expert token counts stay a device tensor (no host sync)."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, recipe: str, device: str) -> None:
        super().__init__()
        dtype = getattr(torch, gg.get_recipe(recipe).plain_dtype or "bfloat16")
        self.router = torch.nn.Linear(hidden, experts, bias=False, dtype=dtype, device=device)
        self.gate_up = gg.GroupedLinear(experts, hidden, 2 * ffn, bias=False, recipe=recipe, device=device)
        self.down = gg.GroupedLinear(experts, ffn, hidden, bias=False, recipe=recipe, device=device)
        self.experts, self.top_k = experts, top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).float().softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)  # rows grouped by expert
        counts = torch.zeros(self.experts, dtype=torch.int64, device=x.device)
        counts.index_add_(0, flat, torch.ones_like(flat))
        token = order // self.top_k  # permuted row -> source token
        gate, up = self.gate_up(x[token], counts).chunk(2, dim=-1)
        y = self.down(F.silu(gate) * up, counts)
        y = y * weights.flatten()[order, None].to(y.dtype)
        return torch.zeros_like(x).index_add_(0, token, y)  # unpermute: sum the k expert outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--recipe", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) the student")
    args = parser.parse_args()

    torch.manual_seed(0)
    sizes = {"hidden": 64, "ffn": 96, "experts": 8, "top_k": 2}
    teacher = MoEBlock(**sizes, recipe=args.recipe, device=args.device).requires_grad_(False)
    student = MoEBlock(**sizes, recipe=args.recipe, device=args.device)
    model = torch.compile(student, fullgraph=True) if args.compile else student
    optimizer = torch.optim.Adam(student.parameters(), lr=3e-3)
    dtype = student.router.weight.dtype

    x = torch.randn(args.tokens, sizes["hidden"], device=args.device, dtype=dtype)
    with torch.no_grad():
        target = teacher(x)

    gg.reset_dispatch_stats()
    start = time.perf_counter()
    for step in range(args.steps):
        loss = F.mse_loss(model(x).float(), target.float()) / target.float().pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  relative loss {loss.item():.4f}")
    elapsed = time.perf_counter() - start

    stats = gg.dispatch_stats()
    print(f"{args.steps} steps in {elapsed:.1f} s on {args.device} ({args.recipe})")
    # Per step: 2 forward GEMMs, the down layer's dgrad, and both layers' wgrad (the
    # gate-up input needs no gradient, so its dgrad is skipped).
    print(f"grouped GEMM calls: {stats['calls']} ({stats['calls'] // args.steps} per step)")
    for name, calls in sorted(stats["selected"].items()):
        print(f"  backend {name}: {calls} calls")
    if stats["fallbacks"]:
        print(f"  fallbacks: {stats['fallbacks']}, skipped: {stats['skipped']}")


if __name__ == "__main__":
    main()
