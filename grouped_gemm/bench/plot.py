"""Optional PNG of a run: TFLOP/s per case, one panel per (op, splits, recipe), bars per backend.

matplotlib is not a dependency: ``missing()`` says so clearly, and the run goes on
without the picture.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from grouped_gemm.bench.runner import Row

MISSING = "the plot needs matplotlib, which is not installed here (pip install matplotlib); table and JSON are complete"


def missing() -> str | None:
    """None when matplotlib can be imported, else the message to print."""
    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else MISSING


def write_png(rows: list[Row], path: Path, title: str) -> None:
    """Grouped bars of TFLOP/s (peer included); wrong results are hatched and labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[tuple[str, str, str], list[Row]] = {}
    for r in rows:
        if r.tflops is not None:
            panels.setdefault((r.op, r.splits, r.recipe), []).append(r)
    if not panels:
        panels[("no timed results", "", "")] = []
    roles = {r.backend: r.role for group in panels.values() for r in group}
    backends = sorted(roles, key=lambda name: (roles[name] != "peer", name))
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 3.2 * len(panels)), squeeze=False)
    width = 0.8 / max(1, len(backends))
    for ax, ((op, splits, recipe), group) in zip(axes[:, 0], panels.items(), strict=True):
        cases = list(dict.fromkeys(r.case for r in group))
        for j, backend in enumerate(backends):
            xs, ys, wrong = [], [], []
            for r in group:
                if r.backend == backend:
                    xs.append(cases.index(r.case) + j * width)
                    ys.append(r.tflops)
                    wrong.append(r.status == "wrong")
            if xs:
                bars = ax.bar(xs, ys, width, label=backend)
                for bar, bad in zip(bars, wrong, strict=True):
                    if bad:
                        bar.set_hatch("xx")
                        ax.annotate("WRONG", (bar.get_x(), bar.get_height()), fontsize=7, color="red")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], cases, rotation=20, fontsize=8)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{op} {recipe} {splits}".strip(), fontsize=10)
        ax.legend(fontsize=7, ncol=4)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
