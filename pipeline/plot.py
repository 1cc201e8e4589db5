"""`python -m pipeline plot RUN_DIR [RUN_DIR ...]`: a PNG report of one run, or of several on
the same axes: reward (train and held-out), loss, the engine/trainer mismatch, the step-time
breakdown, lag and throughput, read from each run's `metrics.jsonl` and `eval.jsonl`.
Needs matplotlib (`pip install matplotlib`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError
from pipeline.metrics import EVAL_FILE, STEPS_FILE, read

# The parts of a step's wall time, stacked in this order in a one-run report.
STEP_PARTS = ("wait", "stand_down", "train", "refit", "wake", "save")


class PlotError(PipelineError):
    exit_code = 2


def new_figure(width: float, height: float) -> Any:
    """A matplotlib Figure outside pyplot: no global backend switch or figure registry, so a
    host application's own plotting is left as it was."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotError("plotting needs matplotlib: pip install matplotlib") from None
    return Figure(figsize=(width, height))


def colour_cycle() -> list[str]:
    import matplotlib

    return matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    points = [(r["step"], r[key]) for r in records if key in r and "step" in r]
    return ([p[0] for p in points], [p[1] for p in points]) if points else ([], [])


def _smooth(values: list[float]) -> list[float]:
    """A trailing mean over about 1/50 of the run, so long runs stay readable."""
    window = max(1, len(values) // 50)
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _line(
    ax: Any,
    steps: list[dict[str, Any]],
    colour: str,
    key: str,
    label: str,
    style: str = "-",
    *,
    smooth: bool = True,
) -> None:
    x, y = _series(steps, key)
    if x:
        ax.plot(x, _smooth(y) if smooth else y, style, color=colour, label=label)


def load_run(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    steps_file = run_dir / STEPS_FILE
    if not steps_file.is_file():
        raise PlotError(f"{run_dir}: no {STEPS_FILE} here (is it a run directory?)")
    evals_file = run_dir / EVAL_FILE
    return read(steps_file), read(evals_file) if evals_file.is_file() else []


def write_report(run_dirs: Sequence[Path], out: Path) -> Path:
    """Draw the report of `run_dirs` (one colour per run) into the PNG `out`."""
    runs = [(Path(d), *load_run(Path(d))) for d in run_dirs]
    figure = new_figure(16, 8.5)
    (reward, loss, mismatch), (timing, lag, throughput) = figure.subplots(2, 3)
    colours = colour_cycle()
    single = len(runs) == 1
    for index, (run_dir, steps, evals) in enumerate(runs):
        colour = colours[index % len(colours)]
        name = run_dir.resolve().name if single else str(run_dir)

        _line(reward, steps, colour, "reward/mean", f"{name}: train")
        x, y = _series(evals, "eval/reward")
        if x:
            reward.plot(x, y, "o--", color=colour, markersize=3, label=f"{name}: held-out")
        _line(loss, steps, colour, "train/loss", name)
        x, y = _series(steps, "train/token_mult_prob_error")
        if x:
            mismatch.plot(x, [v - 1 for v in y], "-", color=colour, label=f"{name}: mult_prob - 1")
        x, y = _series(steps, "train/gen_kl_error")
        if x:
            mismatch.plot(x, y, ":", color=colour, label=f"{name}: gen_kl")
        if single:
            _stack_step_parts(timing, steps, colours)
        _line(timing, steps, colour, "timing/step_s", "step" if single else f"{name}: step")
        _line(timing, steps, colour, "timing/generate_s", f"{name}: generate (window)", "--")
        _line(lag, steps, colour, "rollout/mean_lag", f"{name}: mean", smooth=False)
        _line(lag, steps, colour, "rollout/max_lag", f"{name}: max", ":", smooth=False)
        _line(throughput, steps, colour, "throughput/tokens_per_s_per_gpu", name)
    for ax, title in (
        (reward, "reward"),
        (loss, "train/loss"),
        (mismatch, "engine vs trainer mismatch"),
        (timing, "seconds per step"),
        (lag, "lag (policy versions)"),
        (throughput, "trained tokens/s per GPU"),
    ):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    mismatch.set_yscale("symlog", linthresh=1e-6)  # exact agreement (0) stays on the axis
    reward.set_ylim(-0.02, 1.02)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=90)
    return out


async def draw_apart(run_dir: Path) -> str | None:
    """Write `run_dir/report.png` from a child process (`python -m pipeline plot`); None when
    it did, else the child's error line.

    Apart, because matplotlib's first import and its drawing hold the GIL for 50-90 ms at a
    time: from a thread they would take that from the event loop of the process that trained.
    """
    import anyio

    here = str(Path(__file__).resolve().parents[1])  # the child imports this very package
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    done = await anyio.run_process(
        [sys.executable, "-m", "pipeline", "plot", str(run_dir), "--log-level", "error"],
        check=False,
        env={**os.environ, "PYTHONPATH": path},
    )
    if done.returncode == 0:
        return None
    lines = done.stderr.decode(errors="replace").strip().splitlines()
    return lines[-1].removeprefix("error: ") if lines else f"exit code {done.returncode}"


def _stack_step_parts(ax: Any, steps: list[dict[str, Any]], colours: list[str]) -> None:
    x = [r["step"] for r in steps if "timing/step_s" in r]
    parts = [(p, [r.get(f"timing/{p}_s", 0.0) for r in steps if "timing/step_s" in r]) for p in STEP_PARTS]
    parts = [(p, ys) for p, ys in parts if any(ys)]
    if x and parts:
        ax.stackplot(
            x,
            *[_smooth(ys) for _, ys in parts],
            labels=[p for p, _ in parts],
            alpha=0.35,
            colors=colours[1 : len(parts) + 1],
        )
