"""What the command-line tools (``check``, ``bench``, ``tune``) share: the ``--device``
option, weights pre-quantized as a recipe would, and a progress line.

The progress line is dependency-free, on stderr: on a terminal it is redrawn in place;
in a log (not a TTY) each step is its own line, so a run's log shows where it was when
it stopped.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

import torch

import grouped_gemm as gg
from grouped_gemm.errors import InvalidArgumentError
from grouped_gemm.splits import SEED_MAX, SEED_MIN


def add_device_option(parser: argparse.ArgumentParser) -> None:
    """``--device auto|cpu|cuda`` (read it with ``torch_device``)."""
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")


def add_seed_option(parser: argparse.ArgumentParser) -> None:
    """``--seed``: an integer ``torch.Generator.manual_seed`` takes (a larger one raised
    OverflowError's ValueError from deep in the run, with a traceback)."""
    parser.add_argument("--seed", type=_seed, default=0, help="seed of the random operands")


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not SEED_MIN <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"invalid seed {text!r}: an integer from -2**63 to 2**64 - 1")
    return value


def torch_device(choice: str) -> torch.device:
    """A command line's ``--device`` (``auto``, ``cpu``, ``cuda``) as a torch device."""
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError("device", choice, "'cpu' on this machine: torch sees no GPU")
    return torch.device(choice)


def prequantized_weight(w: torch.Tensor, recipe: str, op: str) -> gg.MXTensor:
    """``w`` as the MXTensor ``recipe`` would make of it for ``op`` (fwd or dgrad): its
    weight format, scale rule and block size, blocked along the op's contraction axis."""
    r = gg.get_recipe(recipe)
    return gg.quantize_mx_weight(w, r.weight_format, op=op, scale_rule=r.scale_rule, block_size=r.block_size)


class Progress:
    """``step(label)`` before each of ``total`` units of work; ``close()`` at the end."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.done = 0
        self.started = time.perf_counter()
        self.inline = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()

    def _eta(self) -> str:
        if not self.done:
            return "eta ?"
        left = (time.perf_counter() - self.started) / self.done * (self.total - self.done)
        return f"eta {int(left // 60)}m{int(left % 60):02d}s"

    def step(self, label: str) -> None:
        if not self.enabled:
            return
        width = len(str(self.total))
        line = f"[{self.done + 1:>{width}}/{self.total}] {self._eta()}  {label}"
        if self.inline:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.done += 1

    def close(self) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.started
        self.stream.write(("\r\033[K" if self.inline else "") + f"done: {self.done} steps in {elapsed:.1f} s\n")
        self.stream.flush()
