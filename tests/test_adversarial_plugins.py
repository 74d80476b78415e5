"""Adversarial pass over the plugin surface: backend specs and registration, the route
cache, the padded_bmm plugin's numerics, the compiled backend's cache directory and the
CLI's bad arguments. Every test here failed before the fix it comes with."""

from __future__ import annotations

import pytest

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
