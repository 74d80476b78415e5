"""One decision serves every M of a power-of-two bucket, so no backend's ``check`` or
``priority`` may tell two Ms of one bucket apart: otherwise the first call of a bucket
would pick the route of every later one (docs/design.md, "Problem").

Every registered backend is asked on described chips, for the smallest and the largest M
of buckets around the thresholds the built-in backends use (16, 64 and 128 rows a group)."""

from __future__ import annotations

import pytest

import grouped_gemm as gg

CHIPS = ("sm_90", "sm_100", "gfx950", "cpu")
RECIPES = ("bf16", "fp32", "mxfp8", "mxfp4", "a16w4")
GROUPS = (8, 32, 128)
#: Bucket tops from 2^8 to 2^17: with G = 8..128 they span 1 to 16384 rows a group.
TOPS = tuple(1 << j for j in range(8, 18))


def _view(m: int, op: str, recipe: str, chip: str, groups: int) -> list[tuple[str, int, tuple[str, ...]]]:
    """Each backend's priority and reason codes (a reason's text may name M itself)."""
    decision = gg.explain(op=op, recipe=recipe, groups=groups, m=m, n=2048, k=4096, device=chip, device_splits=True)
    return [(c.name, c.priority, tuple(sorted(r.code for r in c.reasons))) for c in decision.candidates]


@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
def test_check_and_priority_read_only_the_bucket(chip, op):
    differ = []
    for recipe in RECIPES:
        for groups in GROUPS:
            for top in TOPS:
                least = top // 2 + 1
                if _view(least, op, recipe, chip, groups) != _view(top, op, recipe, chip, groups):
                    differ.append((recipe, groups, least, top))
    assert not differ, f"decisions differ within a bucket (recipe, G, M, M): {differ[:8]}"


def test_the_bucket_is_m_rounded_up_to_a_power_of_two():
    sizes = {m: gg.describe_problem(groups=4, m=m, n=8, k=8, device="cpu").m_bucket for m in (0, 1, 2, 3, 513, 1024)}
    assert sizes == {0: 0, 1: 1, 2: 2, 3: 4, 513: 1024, 1024: 1024}


def _padded_bmm_reasons(m: int, largest: int) -> set[str]:
    """padded_bmm's reason codes for 8 groups of M rows, the first ``largest`` rows."""
    if "padded_bmm" not in {b.name for b in gg.list_backends()}:
        pytest.skip("the padded_bmm plugin is not installed")
    rest = m - largest
    splits = [largest] + [rest // 7] * 6 + [rest - 6 * (rest // 7)]
    decision = gg.explain(op="fwd", groups=8, m=m, n=64, k=64, device="sm_90", splits=splits)
    return {r.code for r in decision.candidate("padded_bmm").reasons}


@pytest.mark.parametrize("m", [1025, 2048])
def test_padding_limit_is_judged_by_the_bucket(m):
    """padded_bmm pads each group to the largest (G x max_rows rows), at most 4x M's bucket.
    A largest group of 600 rows (max_rows 1024) pads 8 groups to 8192 rows: 4x the bucket
    (2048) for both Ms; an M-exact rule refused M = 1025 (8x) and took 2048, so the first
    call of the bucket chose for both. 1025 rows in one group (max_rows 2048) pad to 16384:
    refused for both."""
    assert _padded_bmm_reasons(m, 600) == set()
    assert _padded_bmm_reasons(m, 1025) == {"shape"}
