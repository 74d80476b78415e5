"""Adversarial cases from the thirty-eighth hunt: copied and unpickled ``gg.offsets``,
bench outputs naming one file twice, check given a name twice. Each test failed before
its fix; CPU only, small shapes, fresh random data, float64 references.
"""

from __future__ import annotations

import contextvars
import copy
import json
import pickle
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm import config, testing
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
    assert testing.rel_error(gg.grouped_gemm(x, w, copied), testing.ref_fwd(x, w, sizes)) < 1e-5
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


# ---- scopes left in another thread -----------------------------------------------------------


def test_a_scope_left_in_another_thread_warns():
    """A generator holding ``use_backends`` across a ``yield``, finished in another thread,
    leaves the scope there, where the entering thread's stack cannot be reached: it stayed
    on in that thread (every later call strict on ``reference``), with nothing said. It
    still stays on (a context variable of another thread cannot be edited), but the exit
    warns, naming the rule. Run in a copied context so the stuck scope ends with it."""

    def holder() -> Iterator[int]:
        with gg.use_backends("reference", strict=True):
            yield 1
            yield 2

    def scenario() -> tuple[list[warnings.WarningMessage], tuple]:
        gen = holder()
        next(gen)
        caught: list[warnings.WarningMessage] = []

        def finish() -> None:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                list(gen)
            caught.extend(seen)

        worker = threading.Thread(target=finish)
        worker.start()
        worker.join(timeout=60)
        return caught, config.active_scopes()

    caught, left_on = contextvars.copy_context().run(scenario)
    assert [w.category for w in caught] == [RuntimeWarning], [str(w.message) for w in caught]
    assert "left in another thread or asyncio task than the one that entered it" in str(caught[0].message)
    assert len(left_on) == 1 and left_on[0].strict is True
    assert config.active_scopes() == ()


def test_a_scope_left_in_its_own_thread_is_removed_without_a_warning():
    """The ordinary exit, and an out-of-order one in one thread, stay silent."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outer = gg.use_backends("reference")
        inner = gg.use_backends("torch_grouped_mm")
        outer.__enter__()
        inner.__enter__()
        outer.__exit__(None, None, None)  # out of order: removes only its own frame
        assert [s.order for s in config.active_scopes()] == [(("*", ("torch_grouped_mm",)),)]
        inner.__exit__(None, None, None)
    assert config.active_scopes() == ()
