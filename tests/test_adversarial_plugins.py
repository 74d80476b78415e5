"""Adversarial pass over the plugin surface: backend specs and registration, the route
cache, the padded_bmm plugin's numerics, the compiled backend's cache directory and the
CLI's bad arguments. Every test here failed before the fix it comes with."""

from __future__ import annotations

import pytest
import torch

import grouped_gemm as gg

SPEC = dict(ops={"fwd"}, recipes={"fp32"}, vendors={"cpu"})


@pytest.mark.parametrize("name", ["reference\n", "fine\n", "a\n"])
def test_a_backend_name_with_a_trailing_newline_is_refused(name):
    # `$` matches before a final newline: "reference\n" registered beside "reference",
    # printed the same in every table and unreachable from any order (names are stripped).
    with pytest.raises(ValueError, match="lower-case letters"):
        gg.BackendSpec(name=name, **SPEC)


@pytest.mark.parametrize("field", ["ops", "recipes", "vendors"])
def test_a_spec_that_declares_nothing_is_refused(field):
    # A backend with no ops / recipes / vendors can never run; list_backends (and
    # `grouped-gemm backends`) raised IndexError for every user once one was registered.
    with pytest.raises(ValueError, match=field):
        gg.BackendSpec(name="nothing", **{**SPEC, field: set()})


class _Zeros(gg.Backend):
    def __init__(self, name: str, priority: int) -> None:
        self.spec = gg.BackendSpec(name=name, priority=priority, **SPEC)

    def run(self, problem: gg.Problem, inputs: gg.GroupedInputs) -> torch.Tensor:
        return torch.zeros(problem.m, problem.n)


def test_a_spec_replaced_after_registration_does_not_break_routing(gen):
    # The registry keys a backend by the name it registered with; a plugin that later
    # assigned another spec (another name) made every call that ranked it first raise
    # UnknownBackendError (backend='renamed'), and list_backends too.
    backend = _Zeros("renamer", 10**6)
    gg.register_backend(backend)
    try:
        x, w = torch.randn(6, 4, generator=gen), torch.randn(2, 3, 4, generator=gen)
        assert torch.equal(gg.grouped_gemm(x, w, [2, 4]), torch.zeros(6, 3))
        backend.spec = gg.BackendSpec(name="renamed", priority=10**6, **{**SPEC, "ops": {"dgrad"}})
        gg.reset_config()  # drops the cached routes: the next call decides again
        assert torch.equal(gg.grouped_gemm(x, w, [2, 4]), torch.zeros(6, 3))
        assert gg.explain(x, w, [2, 4]).selected == "renamer"
        names = [info.name for info in gg.list_backends()]
        assert "renamer" in names and "renamed" not in names
    finally:
        gg.unregister_backend("renamer")
    assert "renamer" not in [info.name for info in gg.list_backends()]
