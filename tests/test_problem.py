"""One Problem builder: a described call and a real one build the same Problem, and the
dispatch cache's key covers every field of it."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm.problem import OPS
from grouped_gemm.validation import CallKey

SPLITS = [32, 0, 64]
N, K = 64, 96


def _operands(op: str, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    m = sum(SPLITS)
    w = torch.randn(len(SPLITS), N, K, generator=gen).to(dtype)
    if op == "fwd":
        return torch.randn(m, K, generator=gen).to(dtype), w
    if op == "dgrad":
        return torch.randn(m, N, generator=gen).to(dtype), w
    return torch.randn(m, N, generator=gen).to(dtype), torch.randn(m, K, generator=gen).to(dtype)


def _call(op: str, a: torch.Tensor, b: torch.Tensor, recipe: str, **kw) -> torch.Tensor:
    fn = {"fwd": gg.grouped_gemm, "dgrad": gg.grouped_gemm_dgrad, "wgrad": gg.grouped_gemm_wgrad}[op]
    return fn(a, b, SPLITS, recipe=recipe, **kw)


@pytest.mark.parametrize("recipe", list(gg.RECIPES))
@pytest.mark.parametrize("op", OPS)
def test_explain_without_tensors_is_the_real_call(op, recipe, gen):
    """``explain(op=, recipe=, ...)`` describes exactly what the call with tensors builds
    and runs (the grad_format of an MX wgrad included)."""
    plain = gg.get_recipe(recipe).plain_dtype
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[plain or "bfloat16"]
    a, b = _operands(op, dtype, gen)
    described = gg.explain(op=op, recipe=recipe, groups=len(SPLITS), m=sum(SPLITS), n=N, k=K, splits=SPLITS)
    real = gg.explain(a, b, SPLITS, op=op, recipe=recipe)
    assert described.problem == real.problem
    assert described.problem.grad_format == gg.get_recipe(recipe).grad_format
    assert [(c.name, c.reasons) for c in described.candidates] == [(c.name, c.reasons) for c in real.candidates]
    assert described.selected == real.selected is not None
    _call(op, a, b, recipe)
    assert gg.dispatch_stats()["selected"] == {real.selected: 1}


def test_described_wgrad_accumulating_into_fp32_is_the_real_call(gen):
    dy, x = _operands("wgrad", torch.bfloat16, gen)
    main_grad = torch.zeros(len(SPLITS), N, K)
    real = gg.explain(dy, x, SPLITS, op="wgrad", out=main_grad, accumulate=True)
    described = gg.explain(
        op="wgrad", groups=len(SPLITS), m=sum(SPLITS), n=N, k=K, splits=SPLITS, out_dtype=torch.float32, accumulate=True
    )
    assert described.problem == real.problem
    assert (real.problem.out_dtype, real.problem.accumulate) == ("float32", True)
    assert described.selected == real.selected


def test_the_call_key_covers_every_problem_field():
    """A field added to Problem needs its part in the dispatch cache's key (CallKey), or
    two calls that differ in it would share one cached Problem."""
    derived = {"m": "m_bucket", "placement": "device", "scale_rule": "recipe", "grad_format": "recipe"}
    fields = {f.name for f in dataclasses.fields(gg.Problem) if f.init}
    assert {derived.get(f, f) for f in fields} <= set(CallKey._fields)


def test_a_cached_route_serves_every_m_of_its_bucket_with_its_own_problem(make_backend, gen):
    backend = make_backend("probe", priority=10_000)
    seen = []
    run = backend.run

    def record(problem, inputs):
        seen.append(problem.m)
        return run(problem, inputs)

    backend.run = record
    x, w = torch.randn(12, 8, generator=gen), torch.randn(3, 4, 8, generator=gen)
    for rows, splits in ((12, [5, 0, 7]), (10, [5, 0, 5]), (12, [5, 0, 7]), (9, [4, 0, 5])):
        out = gg.grouped_gemm(x[:rows], w, splits)
        assert out.shape == (rows, 4)
    assert seen == [12, 10, 12, 9]
    assert backend.checks == 1  # M 9, 10 and 12 share the power-of-two bucket 16


def test_split_facts_of_recent_tuples_match_a_fresh_walk():
    """The memo of recent host splits gives what one pass over them gives, for tuples (kept,
    bounded) and lists (walked every time)."""
    from grouped_gemm import problem as problem_module

    rng = random.Random(7)
    for _ in range(3 * problem_module._RECENT_FACTS_MAX):
        sizes = tuple(rng.choice([0, 8, 24, 96, 128, 1000]) for _ in range(rng.randint(1, 130)))
        for cap in (1, 16, 128):
            walked = problem_module._walked_facts(list(sizes), cap)
            assert problem_module.split_facts(sizes, m_align_cap=cap) == walked
            assert problem_module.split_facts(sizes, m_align_cap=cap) == walked  # from the memo
            assert problem_module.split_facts(list(sizes), m_align_cap=cap) == walked
        assert len(problem_module._RECENT_FACTS) <= problem_module._RECENT_FACTS_MAX
    assert problem_module.split_facts((0, 0), m_align_cap=16) == (16, 0)
    assert problem_module.split_facts((8, 24), m_align_cap=16) == (8, 32)
