"""`python -m pipeline plot RUN_DIR [RUN_DIR ...]`: a PNG report of one run, or of several on
the same axes: reward (train and held-out), loss, the engine/trainer mismatch, the step-time
breakdown, lag and throughput, read from each run's `metrics.jsonl` and `eval.jsonl`, under a
title line per run (steps, time, final rewards). Needs matplotlib (`pip install matplotlib`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.contracts.errors import PipelineError
from pipeline.metrics import EVAL_FILE, STEPS_FILE, read

# The parts of a step's wall time, stacked in this order in a one-run report, with their labels.
STEP_PARTS = {
    "wait": "waiting for its batch",
    "stand_down": "engine standing down",
    "train": "training",
    "refit": "sending weights to the engine",
    "wake": "engine waking",
    "save": "saving a checkpoint",
}
FEW_POINTS = 5  # a series this short is drawn with markers: one point makes no line


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


def _plot(ax: Any, x: list[float], y: list[float], style: str, **options: Any) -> None:
    if len(x) < FEW_POINTS and "o" not in style:
        options["marker"] = "o"
    ax.plot(x, y, style, **options)


def _line(
    ax: Any, steps: list[dict[str, Any]], key: str, style: str = "-", *, smooth: bool = True, **options: Any
) -> None:
    x, y = _series(steps, key)
    if x:
        _plot(ax, x, _smooth(y) if smooth else y, style, **options)


def load_run(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    steps_file = run_dir / STEPS_FILE
    if not steps_file.is_file():
        raise PlotError(f"{run_dir}: no {STEPS_FILE} here (is it a run directory?)")
    evals_file = run_dir / EVAL_FILE
    return read(steps_file), read(evals_file) if evals_file.is_file() else []


def on_gpu(run_dir: Path) -> bool:
    """Whether the run's resolved recipe put the model on a GPU."""
    import yaml

    try:
        recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text()) or {}
    except OSError:
        return False
    return str((recipe.get("model") or {}).get("device", "cpu")).startswith("cuda")


def headline(name: str, steps: list[dict[str, Any]], evals: list[dict[str, Any]]) -> str:
    """One line about a run: how many steps, how long, the final rewards."""
    seconds = sum(r.get("timing/step_s", 0.0) for r in steps) + sum(
        r.get("timing/eval_s", 0.0) for r in evals
    )
    parts = [f"{name}: {len(steps)} step{'s' if len(steps) != 1 else ''} in {_duration(seconds)}"]
    if steps and "reward/mean" in steps[-1]:
        parts.append(f"final reward {steps[-1]['reward/mean']:.2f} (train)")
    if evals and "eval/reward" in evals[-1]:
        parts.append(f"{evals[-1]['eval/reward']:.2f} (held-out, step {evals[-1].get('step', '?')})")
    return ", ".join(parts)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes = seconds / 60
    return f"{minutes:.1f} min" if minutes < 120 else f"{minutes / 60:.1f} h"


def steady_top(steps: list[dict[str, Any]]) -> float | None:
    """An upper limit for seconds per step that shows the steady state: the slow first steps
    (start-up, the first compiles) and rare spikes run off the top instead of flattening it."""
    values = sorted(r["timing/step_s"] for r in steps[len(steps) // 10 :] if "timing/step_s" in r)
    if len(values) < 10:
        return None
    top = 1.5 * values[int(0.95 * (len(values) - 1))]
    return top if top < max(r.get("timing/step_s", 0.0) for r in steps) else None


def write_report(run_dirs: Sequence[Path], out: Path) -> Path:
    """Draw the report of `run_dirs` (one colour per run) into the PNG `out`."""
    runs = [(Path(d), *load_run(Path(d))) for d in run_dirs]
    figure = new_figure(16, 9)
    from matplotlib.ticker import MaxNLocator

    (reward, loss, mismatch), (timing, lag, throughput) = figure.subplots(2, 3)
    colours = colour_cycle()
    single = len(runs) == 1
    tops = []
    for index, (run_dir, steps, evals) in enumerate(runs):
        # Later runs drawn thinner, so a run identical to an earlier one still shows.
        style: dict[str, Any] = {
            "color": colours[index % len(colours)],
            "linewidth": max(1.0, 2.2 - 0.6 * index),
        }
        name = run_dir.resolve().name if single else str(run_dir)
        prefix = "" if single else f"{name}: "

        _line(reward, steps, "reward/mean", label=f"{prefix}train (mean of the step's samples)", **style)
        x, y = _series(evals, "eval/reward")
        if x:
            _plot(reward, x, y, "o--", markersize=3, label=f"{prefix}held-out (greedy)", **style)
        _line(loss, steps, "train/loss", label=name, **style)
        x, y = _series(steps, "train/token_mult_prob_error")
        if x:
            _plot(mismatch, x, [v - 1 for v in y], "-", label=f"{prefix}mean exp|difference| - 1", **style)
        _line(mismatch, steps, "train/gen_kl_error", ":", smooth=False, label=f"{prefix}KL estimate", **style)
        if single:
            _stack_step_parts(timing, steps, colours)
        _line(timing, steps, "timing/step_s", label=f"{prefix}whole step", **style)
        _line(timing, steps, "timing/generate_s", "--", label=f"{prefix}generating its batch", **style)
        # Not a part of the step: the checkpoint written in the background while steps ran.
        _line(
            timing,
            steps,
            "timing/save_write_s",
            "-.",
            smooth=False,
            label=f"{prefix}checkpoint write (background)",
            **style,
        )
        _line(lag, steps, "rollout/mean_lag", smooth=False, label=f"{prefix}mean", **style)
        _line(lag, steps, "rollout/max_lag", ":", smooth=False, label=f"{prefix}max", **style)
        _line(throughput, steps, "throughput/tokens_per_s_per_gpu", label=name, **style)
        tops.append(steady_top(steps))
    per_gpu = " per GPU" if any(on_gpu(run_dir) for run_dir, _, _ in runs) else ""
    for ax, title in (
        (reward, "reward (1 = every answer right)"),
        (loss, "training loss (GRPO's clipped objective)"),
        (mismatch, "engine vs trainer: same tokens' log-probabilities (0 = identical)"),
        (timing, "seconds per step, and where they went"),
        (lag, "lag: how many weight versions old the generating model was"),
        (throughput, f"trained tokens per second{per_gpu}"),
    ):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("train step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    mismatch.set_yscale("symlog", linthresh=1e-6)  # exact agreement (0) stays on the axis
    # Rewards of 0-1, unless a run's go higher (a multi-turn episode's sum of turn rewards).
    highest = [r["reward/mean"] for _, steps, _ in runs for r in steps if "reward/mean" in r]
    reward.set_ylim(-0.02, max([1.02, *(v * 1.02 for v in highest)]))
    if tops and all(top is not None for top in tops):
        timing.set_ylim(0, max(t for t in tops if t is not None))
        timing.set_title(
            "seconds per step, and where they went (slow first steps run off the top)", fontsize=10
        )
    figure.suptitle(
        "\n".join(
            headline(run_dir.resolve().name if single else str(run_dir), steps, evals)
            for run_dir, steps, evals in runs
        ),
        fontsize=12,
    )
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

    from pipeline.startup import say

    say("drawing %s", run_dir / "report.png")  # seconds: matplotlib loads in the child
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
    if len(x) > 1 and parts:
        ax.stackplot(
            x,
            *[_smooth(ys) for _, ys in parts],
            labels=[STEP_PARTS[p] for p, _ in parts],
            alpha=0.35,
            colors=colours[1 : len(parts) + 1],
        )
