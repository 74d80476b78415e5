"""Where and with what a benchmark ran: device, driver, versions, date, git commit.

Recorded in every result file so that a number can be traced to the run that made it.
"""

from __future__ import annotations

import datetime
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import grouped_gemm


def _run(args: list[str], cwd: Path | None = None) -> str | None:
    try:
        done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_state() -> dict[str, Any]:
    """The commit of the checkout ``grouped_gemm`` is imported from, and whether it has
    uncommitted changes (None outside a git checkout, e.g. an installed wheel)."""
    root = Path(grouped_gemm.__file__).resolve().parent.parent
    commit = _run(["git", "rev-parse", "HEAD"], cwd=root)
    if commit is None:
        return {"commit": None, "dirty": None}
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root)
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def _driver_version() -> str | None:
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def describe(device: torch.device) -> dict[str, Any]:
    """Device, software versions, date and git state, as JSON-ready values."""
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "grouped_gemm": grouped_gemm.__version__,
        "command": " ".join(sys.argv),
        "git": git_state(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["device"] = {
            "type": "cuda",
            "name": props.name,
            "arch": grouped_gemm.describe_problem(groups=1, m=1, n=1, k=1).device.arch,
            "multiprocessors": props.multi_processor_count,
            "memory_bytes": props.total_memory,
            "l2_bytes": getattr(props, "L2_cache_size", None),
            "cuda_runtime": torch.version.cuda,
            "hip_runtime": torch.version.hip,
            "driver": _driver_version(),
        }
    else:
        info["device"] = {
            "type": "cpu",
            "name": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
        }
    return info
