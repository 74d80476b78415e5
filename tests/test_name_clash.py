"""The Megatron-style ``grouped_gemm`` distribution shares our import name: detected and named."""

from __future__ import annotations

import sys
import warnings

import pytest

from grouped_gemm import name_clash


def _fake_distribution(root, name: str, files: list[str]) -> None:
    info = root / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in [*files, f"{info.name}/METADATA"]))


def test_this_environment_has_no_clash():
    assert name_clash.clashing_distributions() == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        name_clash.warn_if_clashing()


def test_another_distribution_with_the_package_is_named_once(tmp_path, monkeypatch):
    _fake_distribution(tmp_path, "grouped_gemm", ["grouped_gemm/__init__.py", "grouped_gemm/ops.py"])
    _fake_distribution(tmp_path, "unrelated", ["unrelated/__init__.py", "unrelated/grouped_gemm/__init__.py"])
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    assert name_clash.clashing_distributions() == ["grouped_gemm"]
    with pytest.warns(name_clash.NameClashWarning) as record:
        name_clash.warn_if_clashing()
    assert len(record) == 1
    message = str(record[0].message)
    assert "also installed by grouped_gemm" in message
    assert "pip uninstall grouped_gemm" in message and "grouped_gemm.ops.gmm" in message


def test_our_own_distribution_is_not_a_clash(tmp_path, monkeypatch):
    _fake_distribution(tmp_path, "moe_grouped_gemm", ["grouped_gemm/__init__.py"])
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    assert name_clash.clashing_distributions() == []
