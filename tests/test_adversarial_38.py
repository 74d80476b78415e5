"""Adversarial cases from the thirty-eighth hunt: copied and unpickled ``gg.offsets``,
bench outputs naming one file twice, check given a name twice. Each test failed before
its fix; CPU only, small shapes, fresh random data, float64 references.
"""

from __future__ import annotations

import copy
import json
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm import testing
from grouped_gemm.bench import command
from grouped_gemm.cli import build_parser, main

# ---- copies of gg.offsets ----------------------------------------------------------------

COPIES: dict[str, Callable[[gg.GroupOffsets], gg.GroupOffsets]] = {
    "copy": copy.copy,
    "deepcopy": copy.deepcopy,
    "pickle": lambda offs: pickle.loads(pickle.dumps(offs)),
}


@pytest.mark.parametrize("how", sorted(COPIES))
@pytest.mark.parametrize("source", ["list", "tensor"])
def test_a_copied_or_unpickled_offsets_gives_the_right_numbers(how: str, source: str) -> None:
    """A module's state is deep-copied (EMA, checkpoints) or pickled to a worker: the copy
    was refused on every call as "written in place since" before anything was written."""
    sizes = torch.randint(0, 9, (5,)).tolist()
    offs = gg.offsets(sizes if source == "list" else torch.tensor(sizes))
    copied = COPIES[how](offs)
    x = torch.randn(sum(sizes), 24, dtype=torch.float32)
    w = torch.randn(len(sizes), 16, 24, dtype=torch.float32)
    want = torch.cat([xg @ wg.T for xg, wg in zip(x.double().split(sizes), w.double(), strict=True)])
    assert testing.rel_error(gg.grouped_gemm(x, w, copied), want) < 1e-5
    assert copied.total == sum(sizes) and len(copied) == len(sizes)


@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_copy_of_offsets_written_in_place_stays_refused(how: str) -> None:
    offs = gg.offsets([4, 2, 6])
    offs.splits[0] = 3
    with pytest.raises(gg.SplitsError, match="written in place"):
        gg.grouped_gemm(torch.randn(12, 8), torch.randn(3, 4, 8), COPIES[how](offs))


def test_an_unpickled_offsets_whose_parts_disagree_is_named() -> None:
    """A pickle may come from anywhere: its parts are checked as a hand-built one's are."""
    offs = gg.offsets([4, 2, 6])
    rebuild, (splits, _, total, written) = offs.__reduce__()
    with pytest.raises(gg.SplitsError, match="ends"):
        rebuild(splits, torch.tensor([4, 5, 12], dtype=torch.int32), total, written)


# ---- bench outputs -------------------------------------------------------------------------


@pytest.mark.parametrize(("first", "second"), [("--out", "--markdown"), ("--markdown", "--plot"), ("--out", "--plot")])
def test_bench_refuses_two_outputs_naming_one_file(tmp_path: Path, first: str, second: str) -> None:
    """They are written one after another: --out x --markdown x left Markdown in the JSON
    file and printed "wrote x" twice."""
    path = tmp_path / "result"
    args = build_parser().parse_args(["bench", "--cases", "mixtral_down", "--device", "cpu", first, str(path)])
    setattr(args, second.lstrip("-"), tmp_path / "." / "result")
    with pytest.raises(gg.InvalidArgumentError, match=rf"{second.lstrip('-')}=.*other than {first}"):
        command.options(args)
    assert not path.exists()


def test_bench_json_survives_beside_a_markdown_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    argv = ["--cases", "mixtral_down", "--ops", "fwd", "--splits", "balanced", "--backends", "reference"]
    argv += ["--no-peer", "--quiet", "--rep-ms", "1", "--warmup-ms", "0", "--min-reps", "1", "--max-reps", "1"]
    assert main(["bench", *argv, "--device", "cpu", "--out", str(out), "--markdown", str(md)]) == 0
    assert json.loads(out.read_text())["rows"] and md.read_text().startswith("Command:")
    assert main(["bench", *argv, "--device", "cpu", "--out", str(out), "--markdown", str(out)]) == 2
    assert "markdown=" in capsys.readouterr().err


# ---- check ---------------------------------------------------------------------------------


def test_check_counts_a_backend_named_twice_once(capsys: pytest.CaptureFixture[str]) -> None:
    """A name given twice was checked twice: the table and summary counted double runs."""
    argv = ["check", "--recipes", "fp32,fp32", "--ops", "fwd", "--quiet"]
    assert main([*argv, "--backends", "reference"]) == 0
    once = capsys.readouterr().out
    assert main([*argv, "--backends", "reference, reference"]) == 0
    assert capsys.readouterr().out == once
