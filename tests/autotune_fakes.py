"""Backends of controlled speed and correctness, and a virtual clock, for the autotuning tests.

Also a script (``python autotune_fakes.py``) that a test runs in a fresh process: it
prints ``tune_once()`` as JSON.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Iterator

import torch

import grouped_gemm as gg
from grouped_gemm.registry import registry


@contextlib.contextmanager
def only_registered() -> Iterator[Callable[..., None]]:
    """Every registered backend taken out for the block; yields ``add(*backends)`` that
    registers the test's own. On exit those go and the originals come back, pass or fail."""
    reg = registry()
    saved = [(e.backend, e.plugin) for e in reg.entries()]
    for backend, _ in saved:
        reg.unregister(backend.spec.name)

    def add(*backends: gg.Backend) -> None:
        for backend in backends:
            reg.register(backend, plugin="test")

    try:
        yield add
    finally:
        for name in reg.names():
            reg.unregister(name)
        for backend, plugin in saved:
            reg.register(backend, plugin)


class FakeClock:
    """A virtual clock in place of ``grouped_gemm.clock.Clock`` (patch ``autotune.Clock``
    with it: calling it returns itself). Backends given it advance it by their delay
    instead of sleeping, so times are exact; with a ``swing`` the machine's speed
    oscillates as a GPU's clock does under load, a call taking
    ``delay * (1 + swing * sin(2 pi (now / period_s + phase)))``."""

    def __init__(self, swing: float = 0.0, period_s: float = 1.0, phase: float = 0.0) -> None:
        self.now = 0.0
        self.swing = swing
        self.period_s = period_s
        self.phase = phase

    def __call__(self, cuda: bool) -> FakeClock:
        return self

    def advance(self, seconds: float) -> None:
        self.now += seconds * (1.0 + self.swing * math.sin(2.0 * math.pi * (self.now / self.period_s + self.phase)))

    def stamp(self) -> float:
        return self.now

    def sync(self) -> None:
        pass

    def ms(self, start: float, end: float) -> float:
        return (end - start) * 1e3


class TimedBackend(gg.Backend):
    """fwd / wgrad in fp32 per group, after ``delay`` seconds of sleep (its speed), or of
    ``clock`` time when given one.

    ``scale`` != 1 makes it wrong by that factor; ``fail`` makes it raise.
    ``configs`` (a list of dicts with a ``delay`` each) exposes the tuner's config hook.
    """

    def __init__(
        self,
        name: str,
        *,
        delay: float = 0.0,
        priority: int = 0,
        scale: float = 1.0,
        fail: bool = False,
        configs: list[dict] | None = None,
        clock: FakeClock | None = None,
    ) -> None:
        self.spec = gg.BackendSpec(
            name=name,
            ops=frozenset({"fwd", "wgrad"}),
            recipes=frozenset({"fp32"}),
            vendors=frozenset({"cpu"}),
            priority=priority,
        )
        self.delay = delay
        self.scale = scale
        self.fail = fail
        self.clock = clock
        self.runs = 0
        self.config_runs: dict[str, int] = {}
        if configs is not None:
            self.configs = lambda problem: list(configs)

    def run(self, problem: gg.Problem, inputs: gg.GroupedInputs) -> torch.Tensor:
        self.runs += 1
        return self._compute(problem, inputs, self.delay)

    def run_config(self, problem: gg.Problem, inputs: gg.GroupedInputs, config: dict) -> torch.Tensor:
        key = json.dumps(config, sort_keys=True)
        self.config_runs[key] = self.config_runs.get(key, 0) + 1
        return self._compute(problem, inputs, config["delay"])

    def _compute(self, problem: gg.Problem, inputs: gg.GroupedInputs, delay: float) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("boom")
        if self.clock is None:
            time.sleep(delay)
        else:
            self.clock.advance(delay)
        splits = inputs.splits_list()
        a, b = inputs.a, inputs.b
        if problem.op == "fwd":
            out = inputs.out if inputs.out is not None else torch.empty(problem.m, problem.n)
            start = 0
            for g, rows in enumerate(splits):
                out[start : start + rows] = (a[start : start + rows] @ b[g].T) * self.scale
                start += rows
            return out
        out = inputs.out if inputs.out is not None else torch.empty(problem.groups, problem.n, problem.k)
        start = 0
        for g, rows in enumerate(splits):
            grad = (a[start : start + rows].T @ b[start : start + rows]) * self.scale
            if problem.accumulate:
                out[g] += grad
            else:
                out[g] = grad
            start += rows
        return out


def tune_once() -> dict:
    """Register two fakes, make one fp32 call with autotuning on, unregister them; what
    was chosen and the tuner's counters. The same in every process, so the same file."""
    fakes = (TimedBackend("sub_fast", delay=0.001), TimedBackend("sub_slow", delay=0.004, priority=100))
    for backend in fakes:
        gg.register_backend(backend)
    try:
        gen = torch.Generator().manual_seed(0)
        x, w = torch.randn(48, 32, generator=gen), torch.randn(3, 16, 32, generator=gen)
        with gg.use_backends(autotune=True):
            gg.grouped_gemm(x, w, [16, 0, 32])
            decision = gg.explain(x, w, [16, 0, 32])
        return {"selected": decision.selected, "autotune": gg.dispatch_stats()["autotune"]}
    finally:
        for backend in fakes:
            gg.unregister_backend(backend.spec.name)


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(tune_once()))
