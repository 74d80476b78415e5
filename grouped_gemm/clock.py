"""Clock: start/stop stamps around device work, shared by autotuning and the benchmark.

On a GPU a host clock would time the launch, not the kernel: CUDA events recorded on the
current stream time the device work itself. On the CPU the work is synchronous, so the
host's ``perf_counter`` does.
"""

from __future__ import annotations

import time

import torch


class Clock:
    """Stamps around calls on one device kind: CUDA events, or the host clock."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def stamp(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def sync(self) -> None:
        """Wait for the device, so every stamp taken so far can be read."""
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, start: object, end: object) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3
