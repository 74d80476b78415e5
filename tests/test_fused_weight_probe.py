"""benchmarks/fused_weight_probe.py's kernel in Triton's interpreter: plain, it is the bf16
grouped product; with ``QUANT`` it is the product with the weight quantized to E4M3 by
``gg.quantize_mx_weight`` (its timings are only worth reading if both hold)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm.backends.triton_mx import launch

_spec = importlib.util.spec_from_file_location(
    "fused_weight_probe", Path(__file__).resolve().parents[1] / "benchmarks" / "fused_weight_probe.py"
)
probe_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe_module)

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or not launch.interpreted(), reason="CPU tests run the kernel in Triton's interpreter"
)

CONFIG = argparse.Namespace(bm=32, bn=32, bk=64, warps=4, stages=1)


@pytest.mark.parametrize("op", ["fwd", "dgrad"])
@pytest.mark.parametrize("quant", [0, 1])
@pytest.mark.parametrize("splits", [[5, 0, 40], [70]], ids=["skewed-empty", "one-group"])
def test_probe_kernel_computes_the_grouped_product(op, quant, splits):
    groups, n, k = len(splits), 64, 96
    w = torch.randn(groups, n, k, dtype=torch.bfloat16)
    a = torch.randn(sum(splits), k if op == "fwd" else n, dtype=torch.bfloat16)
    out = torch.full((sum(splits), n if op == "fwd" else k), float("nan"), dtype=torch.bfloat16)
    tiles = probe_module.tile_table(splits, CONFIG.bm, a.device)
    got = probe_module.probe(a, w, tiles, op, quant, CONFIG, out)
    weight = gg.quantize_mx_weight(w, "e4m3", op=op).dequantize() if quant else w
    parts, start = [], 0
    for g, size in enumerate(splits):
        wg = weight[g].double()
        parts.append(a[start : start + size].double() @ (wg.T if op == "fwd" else wg))
        start += size
    ref = torch.cat(parts)
    assert not got.isnan().any()
    assert ((got.double() - ref).norm() / ref.norm()).item() < 4e-3  # bf16 output rounding
    if quant:  # and not the plain product: E4M3 rounding is ~30x larger
        plain = torch.cat([a[:5].double() @ (w[0].double().T if op == "fwd" else w[0].double())])
        assert ((got[:5].double() - plain).norm() / plain.norm()).item() > 1e-2
