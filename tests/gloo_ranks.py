"""Two (or more) ranks of a gloo job on the loopback, each a fresh ``python SCRIPT FLAG
rank store out_dir`` writing its results to ``out_dir/rank<r>.json``: tests that need a
real process group on the CPU share this launch and its bounded wait."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def gloo_env() -> dict[str, str]:
    """This process's environment for a rank: loopback only, one thread per process (the
    CI machine has two cores, shared by every rank)."""
    return {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


def run_ranks(script: str, flag: str, out_dir: Path, timeout_s: float, world: int = 2) -> list[dict]:
    """Every rank's results; fails with a rank's output if it exits non-zero. A rank still
    running after ``timeout_s`` is killed (a mismatched collective can wait forever)."""
    env = gloo_env()
    procs = [
        subprocess.Popen(
            [sys.executable, script, flag, str(rank), str(out_dir / "store"), str(out_dir)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    try:
        logs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{log}"
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world)]
