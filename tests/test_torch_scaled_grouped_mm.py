"""torch_scaled_grouped_mm on the CPU: its eligibility on described chips, and the E8M0
scale layouts it builds, checked against an index formula and against torch's own meta
checks (``torch._scaled_grouped_mm`` on meta tensors). The kernel needs sm_100; it has
not run here."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm.backends import torch_scaled_grouped_mm as tsg
from grouped_gemm.inputs import GroupedInputs

NAME = "torch_scaled_grouped_mm"


def _swizzled_by_formula(scale: torch.Tensor) -> torch.Tensor:
    """The blocked layout from its definition, one byte at a time."""
    rows, cols = scale.shape
    prow, pcol = -(-rows // 128) * 128, -(-cols // 4) * 4
    out = torch.zeros(prow * pcol, dtype=scale.dtype)
    tiles_per_row_block = pcol // 4
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * tiles_per_row_block + c // 4
            out[tile * 512 + (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4] = scale[r, c]
    return out.reshape(prow, pcol)


@pytest.mark.parametrize("shape", [(128, 4), (200, 5), (31, 1), (257, 9)])
def test_swizzle_matches_the_formula(shape, gen):
    scale = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    assert torch.equal(tsg.swizzle_32_4_4(scale), _swizzled_by_formula(scale))


def test_swizzle_batched(gen):
    scale = torch.randint(0, 256, (3, 70, 6), generator=gen, dtype=torch.uint8)
    got = tsg.swizzle_32_4_4(scale)
    assert got.shape == (3, 128, 8)
    for g in range(3):
        assert torch.equal(got[g], _swizzled_by_formula(scale[g]))


@pytest.mark.parametrize("splits", [[50, 0, 130, 120], [300], [0, 0, 7], [128, 256]])
def test_group_blocked_rows(splits, gen):
    m, cols = sum(splits), 5
    scale = torch.randint(0, 256, (m, cols), generator=gen, dtype=torch.uint8)
    ends = torch.tensor(splits).cumsum(0).to(torch.int32)
    parts, start = [], 0
    for rows in splits:
        part = torch.zeros(-(-rows // 128) * 128, cols, dtype=torch.uint8)
        part[:rows] = scale[start : start + rows]
        parts.append(part)
        start += rows
    want = tsg.swizzle_32_4_4(torch.cat(parts))
    exact = sum(p.shape[0] for p in parts)
    assert torch.equal(tsg.group_blocked_rows(scale, ends, exact), want)
    # Device splits: the bound ceil(M/128)*128 + 128*G rows, the tail all zeros.
    bound = -(-m // 128) * 128 + 128 * len(splits)
    got = tsg.group_blocked_rows(scale, ends, bound)
    assert torch.equal(got[:exact], want) and torch.count_nonzero(got[exact:]) == 0


@pytest.mark.parametrize("op", ["fwd", "dgrad"])
@pytest.mark.parametrize("device_splits", [False, True])
def test_layouts_pass_torchs_meta_checks(op, device_splits, gen):
    groups, m, n, k = 4, 300, 64, 128
    splits = [50, 0, 130, 120]
    problem = gg.describe_problem(op=op, recipe="mxfp8", groups=groups, m=m, n=n, k=k, device="sm_100")
    a = torch.randn(m, k if op == "fwd" else n, generator=gen)
    w = torch.randn(groups, n, k, generator=gen)
    inputs = GroupedInputs(a, w, torch.tensor(splits) if device_splits else splits)
    mat_a, mat_b, scale_a, scale_b, offs = tsg.operands(problem, inputs)
    assert mat_a.dtype == mat_b.dtype == torch.float8_e4m3fn
    assert mat_b.stride(-2) == 1  # column-major, as torch requires
    meta = [t.to("meta") for t in (mat_a, mat_b, scale_a, scale_b, offs)]
    for i in (2, 3):
        meta[i] = meta[i].view(torch.float8_e8m0fnu)
    out = torch._scaled_grouped_mm(*meta[:4], offs=meta[4], out_dtype=torch.bfloat16)
    assert out.shape == (m, n if op == "fwd" else k)
    with pytest.raises(RuntimeError, match="scale shape"):
        torch._scaled_grouped_mm(*meta[:3], meta[3][:, :-1], offs=meta[4], out_dtype=torch.bfloat16)


def _reasons(device: str, **kw) -> list[gg.Reason]:
    fields = dict(op="fwd", recipe="mxfp8", groups=8, m=4096, n=1024, k=1024, device=device)
    fields.update(kw)
    return list(gg.explain(**fields).candidate(NAME).reasons)


def test_eligibility_on_described_chips():
    for arch in ("sm_100", "sm_103"):
        assert _reasons(arch) == [] and _reasons(arch, op="dgrad") == []
        assert _reasons(arch, splits="skewed", device_splits=True) == []
    assert gg.explain(op="fwd", recipe="mxfp8", groups=8, m=4096, n=1024, k=1024, device="sm_100").selected == NAME
    assert [r.code for r in _reasons("sm_90")] == ["arch"]
    assert [r.code for r in _reasons("gfx950")] == ["vendor"]
    assert "placement" in [r.code for r in _reasons("cpu")]
    assert [r.code for r in _reasons("sm_100", op="wgrad")] == ["op"]
    assert [r.code for r in _reasons("sm_100", out_dtype="float32")] == ["dtype"]
    assert [r.code for r in _reasons("sm_100", recipe="mxfp4")] == ["recipe"]
    assert [r.code for r in _reasons("sm_100", groups=1025, m=4100)] == ["groups"]
    fwd_k = [str(r) for r in _reasons("sm_100", k=1040)]  # a multiple of 16, not of 32
    assert fwd_k == ["[align] K=1040 (the contraction) is not a multiple of 32"]
    assert [r.code for r in _reasons("sm_100", op="dgrad", k=1040)] == []
    assert [r.code for r in _reasons("sm_100", n=1000)] == ["align"]


def test_check_refuses_e5m2_gradients_and_host_splits_under_capture():
    backend = tsg.TorchScaledGroupedMMBackend()
    problem = gg.describe_problem(op="dgrad", recipe="mxfp8", groups=2, m=256, n=256, k=256, device="sm_100")
    assert [r.code for r in backend.check(dataclasses.replace(problem, grad_format="e5m2"))] == ["recipe"]
    assert [r.code for r in backend.check(dataclasses.replace(problem, capturing=True))] == ["capture"]
    device_splits = dataclasses.replace(problem, capturing=True, host_splits=False)
    assert backend.check(device_splits) == []


def test_missing_op_is_a_reason(monkeypatch):
    monkeypatch.setattr(tsg, "_SCALED", None)
    problem = gg.describe_problem(recipe="mxfp8", groups=2, m=256, n=256, k=256, device="sm_100")
    reasons = tsg.TorchScaledGroupedMMBackend().check(problem)
    assert [r.code for r in reasons] == ["missing"] and "scaled_grouped_mm" in reasons[0].message
