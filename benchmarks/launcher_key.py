"""Host time of ``CachedLauncher``'s key and cached call, on the CPU (no GPU, no Triton launch).

A stand-in kernel takes a launch shaped like ``launch_upcast``'s (5 tensors, 10 ints,
12 keyword constexprs and options); its "compiled" launcher does nothing, so what is timed
is the launcher's own Python: the key, the cache lookup, the direct-call argument list.
Best of ``--rounds`` rounds of ``--calls`` calls each (the minimum: the machine's noise only adds).

    python benchmarks/launcher_key.py [--calls 20000] [--rounds 25]
"""

from __future__ import annotations

import argparse
import timeit
import types

import torch

from grouped_gemm.triton_launcher import CachedLauncher


class _Compiled:
    function, packed_metadata = "function", "packed"
    run = staticmethod(lambda *args: None)


class _Kernel:
    """A JITFunction's surface as the launcher reads it: params, device caches, ``[grid]``."""

    def __init__(self, positional: int, constexprs: list[str]) -> None:
        names = [f"arg{i}" for i in range(positional)] + constexprs
        self.params = [
            types.SimpleNamespace(name=name, is_constexpr=i >= positional, has_default=False, default=None)
            for i, name in enumerate(names)
        ]
        self.device_caches: dict = {}
        self.pre_run_hooks: list = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _Compiled()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=25)
    opts = parser.parse_args()
    a = torch.zeros(64, 256, dtype=torch.bfloat16)
    w = torch.zeros(8, 2, 256, 16, dtype=torch.int32)
    scales = torch.zeros(8, 2, 256, dtype=torch.int32)
    out = torch.zeros(64, 256)
    splits = torch.zeros(8, dtype=torch.int32)
    args = (a, 256, w, 8192, 16, 4096, scales, 512, 256, out, 256, splits, 8, 256, 256)
    kwargs = dict(BM=16, BN=128, BLOCKS=4, MAX_G=8, NUM_PROGS=132, EVEN_K=True, PTX=True, FOLD=False)
    kwargs |= dict(W_FMT="e2m1", TMA=False, INTERP=False, num_warps=4, num_stages=4)
    launcher = CachedLauncher(_Kernel(len(args), [k for k in kwargs if not k.startswith("num_")]))
    launcher._device, launcher._stream = (lambda: 0), (lambda device: 0)
    launcher((132,), *args, **kwargs)  # the miss: fills the cache
    cases = {
        "key": lambda: launcher.key(0, args, kwargs),
        "key + cache lookup": lambda: launcher._entries.get(launcher.key(0, args, kwargs)),
        "whole cached call (hit, no-op launch)": lambda: launcher((132,), *args, **kwargs),
    }
    for name, fn in cases.items():
        best = min(timeit.repeat(fn, number=opts.calls, repeat=opts.rounds)) / opts.calls
        print(f"{name}: {best * 1e6:.2f} us")
    assert launcher.hits > 0, "the cached path was not taken"


if __name__ == "__main__":
    main()
