"""Configuration: order syntax, environment read once with errors naming the variable."""

from __future__ import annotations

import logging

import pytest

import grouped_gemm as gg
from grouped_gemm.config import parse_order, read_env


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("a,b", (("*", ("a", "b")),)),
        (" a , b ", (("*", ("a", "b")),)),
        (["a"], (("*", ("a",)),)),
        ("mxfp4:t,reference;bf16:g,m", (("bf16", ("g", "m")), ("mxfp4", ("t", "reference")))),
        ({"fp16": "x", "*": ["y"]}, (("*", ("y",)), ("fp16", ("x",)))),
    ],
)
def test_parse_order(value, expected):
    assert parse_order(value) == expected


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("fp8:a", "unknown recipe 'fp8'"),
        ("", "at least one backend"),
        ("a,,b", "non-empty strings"),
        (42, "a string, a list of backend names"),
        # the later entry replaced the earlier one without a word
        ("reference;torch_grouped_mm", r"every recipe \(entries without 'recipe:'\) has two; join them with ','"),
        ("bf16:a;fp16:b;bf16:c", "one order per recipe, but recipe 'bf16' has two"),
        ("a;*:b", "every recipe"),
    ],
)
def test_parse_order_errors(value, text):
    with pytest.raises(gg.ConfigError, match=text):
        parse_order(value)


@pytest.mark.parametrize(
    ("name", "value", "text"),
    [
        ("GROUPED_GEMM_WARN_FALLBACK", "maybe", "a boolean"),
        ("GROUPED_GEMM_STRICT", "2", "a boolean"),
        ("GROUPED_GEMM_LOG_LEVEL", "LOUD", "DEBUG, INFO"),
        ("GROUPED_GEMM_BACKENDS", "fp9:reference", "unknown recipe"),
        ("GROUPED_GEMM_CHECK_SPLITS", "sure", "a boolean"),
    ],
)
def test_invalid_environment_names_the_variable(name, value, text):
    with pytest.raises(gg.ConfigError, match=text) as info:
        read_env({name: value})
    assert info.value.argument == name


def test_environment_is_read_once(monkeypatch):
    monkeypatch.setenv("GROUPED_GEMM_STRICT", "1")
    gg.reset_config()
    assert gg.settings().strict
    monkeypatch.setenv("GROUPED_GEMM_STRICT", "0")
    assert gg.settings().strict
    gg.reset_config()
    assert not gg.settings().strict


def test_unknown_backend_in_environment_names_the_variable(monkeypatch, gen):
    import torch

    monkeypatch.setenv("GROUPED_GEMM_BACKENDS", "no_such_backend")
    gg.reset_config()
    with pytest.raises(gg.UnknownBackendError, match="GROUPED_GEMM_BACKENDS='no_such_backend'"):
        gg.grouped_gemm(torch.randn(4, 4, generator=gen), torch.randn(1, 4, 4, generator=gen), [4])


def test_code_overrides_environment(monkeypatch):
    monkeypatch.setenv("GROUPED_GEMM_WARN_FALLBACK", "1")
    gg.reset_config()
    assert gg.settings().warn_fallback
    assert not gg.configure(warn_fallback=False).warn_fallback


def test_configure_validates(make_backend):
    with pytest.raises(gg.ConfigError, match="strict"):
        gg.configure(strict="often")
    with pytest.raises(gg.ConfigError, match="nonsense"):
        gg.configure(nonsense=1)
    with pytest.raises(gg.UnknownBackendError, match="backends='ghost'"):
        gg.configure(backends=["ghost"])
    with pytest.raises(gg.UnknownBackendError), gg.use_backends("ghost"):
        pass
    with pytest.raises(gg.ConfigError, match="strict"), gg.use_backends(strict="yes"):
        pass


def test_log_level_applies_to_the_logger(monkeypatch):
    monkeypatch.setenv("GROUPED_GEMM_LOG_LEVEL", "debug")
    gg.reset_config()
    assert logging.getLogger("grouped_gemm").level == logging.DEBUG
    gg.configure(log_level="WARNING")
    assert logging.getLogger("grouped_gemm").level == logging.WARNING


def test_a_scope_exited_out_of_order_leaves_no_frame_behind():
    """A generator's scope that closes after its caller's scope used to restore the caller's
    (already exited) scope, routing every later call of the thread by it."""

    def steps():
        with gg.use_backends("reference"):
            yield
            yield

    def order() -> tuple[str, ...]:
        return gg.explain(groups=2, m=8, n=8, k=8).order

    assert order() == ()
    with gg.use_backends("torch_grouped_mm"):
        paused = steps()
        next(paused)  # its scope is entered inside ours and outlives it
    assert order() == ("reference",)
    for _ in paused:
        pass
    assert order() == ()
    outer, inner = gg.use_backends("reference"), gg.use_backends("torch_grouped_mm")
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)
    assert order() == ("torch_grouped_mm",)
    inner.__exit__(None, None, None)
    assert order() == ()


def test_dropping_log_level_gives_the_logger_its_level_back():
    # reset_config() and configure(log_level=None) left the logger at DEBUG: every later
    # decision was formatted and logged.
    logger = logging.getLogger("grouped_gemm")
    logger.setLevel(logging.WARNING)
    try:
        gg.configure(log_level="DEBUG")
        assert logger.level == logging.DEBUG
        gg.reset_config()
        assert logger.level == logging.WARNING
        gg.configure(log_level="ERROR")
        gg.configure(log_level=None)
        assert logger.level == logging.WARNING
    finally:
        logger.setLevel(logging.NOTSET)
