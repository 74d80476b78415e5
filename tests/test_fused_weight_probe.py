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
from grouped_gemm.testing import poison, ref_dgrad, ref_fwd, rel_error

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
    out = poison(torch.empty(sum(splits), n if op == "fwd" else k, dtype=torch.bfloat16))
    tiles = probe_module.tile_table(splits, CONFIG.bm, a.device)
    got = probe_module.probe(a, w, tiles, op, quant, CONFIG, out)
    ref = ref_fwd if op == "fwd" else ref_dgrad
    weight = gg.quantize_mx_weight(w, "e4m3", op=op).dequantize() if quant else w
    assert rel_error(got, ref(a, weight, splits)) < 4e-3  # bf16 output rounding (inf on NaN)
    if quant:  # and not the plain product: E4M3 rounding is ~30x larger
        assert rel_error(got, ref(a, w, splits)) > 1e-2
