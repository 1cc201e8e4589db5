"""A PNG of the reward curves of a run (`run.dir/curve.png`), when matplotlib is installed."""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.metrics import read

log = logging.getLogger("pipeline.plot")

CURVES = ("reward/mean", "eval/reward", "eval/exact_match")


def plot_curves(run_dir: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib is not installed: no curve.png (pip install matplotlib)")
        return None
    records = read(run_dir / "metrics.jsonl")
    figure, axes = plt.subplots(figsize=(7, 4))
    for key in CURVES:
        points = [(r["step"], r[key]) for r in records if key in r and "step" in r]
        if points:
            steps, values = zip(*points, strict=True)
            axes.plot(steps, values, label=key, marker="o" if key.startswith("eval") else None, markersize=3)
    axes.set_xlabel("step")
    axes.set_ylim(0, 1.05)
    axes.grid(alpha=0.3)
    axes.legend()
    path = run_dir / "curve.png"
    figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(figure)
    return path
