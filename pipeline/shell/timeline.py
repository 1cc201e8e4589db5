"""`python -m pipeline timeline RUN_DIR`: a PNG of a window of the run's `trace.json`, one row per
track, for a quick look without Perfetto (the trace itself opens in ui.perfetto.dev or
chrome://tracing). By default the window covers the last three train steps; concurrent lanes of a
track family (`rollout 0`, `rollout 1`, ...) share one row, drawn over each other.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pipeline.shell.plot import PlotError, new_figure

_COLOURS = {
    "generate": "#4c9be8",
    "frozen": "#1f3f73",  # a partial rollout frozen through a stand-down, inside its request
    "score": "#8fcf6b",
    "stand_down": "#e8894c",
    "wake": "#e8c14c",
    "refit": "#e8c14c",
    "train": "#d9534f",
    "save": "#9467bd",
    "eval": "#17becf",
    "wait": "#dddddd",
    "ticket": "#dddddd",
    "load": "#7f7f7f",
    "step": "#f4d0cf",
}


# A label's width per character, as a fraction of the window: 6-point text on a 14-inch axis.
_CHAR_WIDTH = 1 / 330


def _colour(name: str) -> str:
    return _COLOURS.get(name.split()[0], "#bbbbbb")


def load_trace(run_dir: Path) -> tuple[dict[int, str], list[dict[str, Any]]]:
    path = run_dir / "trace.json"
    if not path.is_file():
        raise PlotError(f"{run_dir}: no trace.json here (is it a run directory?)")
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    return names, [e for e in events if e.get("ph") == "X"]


def step_window(spans: list[dict[str, Any]], first: int | None, last: int | None) -> tuple[float, float]:
    """The time range (µs) from the start of step `first` to the end of step `last`."""
    steps = {}
    for span in spans:
        match = re.fullmatch(r"step (\d+)", span["name"])
        if match:
            steps[int(match.group(1))] = span
    if not steps:
        raise PlotError("the trace has no train steps")
    last = max(steps) if last is None else last
    first = max(min(steps), last - 2) if first is None else first
    if first not in steps or last not in steps or first > last:
        raise PlotError(f"steps {first}..{last} are not in the trace (it has {min(steps)}..{max(steps)})")
    # Include the wait for data before the first step: that is where generation overlaps.
    start = steps[first]["ts"]
    waits = [s["ts"] for s in spans if s["name"] == f"wait batch {steps[first]['args'].get('batch')}"]
    start = min([start, *waits])
    return start, steps[last]["ts"] + steps[last]["dur"]


def write_timeline(run_dir: Path, out: Path, *, first: int | None = None, last: int | None = None) -> Path:
    names, spans = load_trace(run_dir)
    start, end = step_window(spans, first, last)
    shown = [s for s in spans if s["ts"] < end and s["ts"] + s["dur"] > start]
    shown.sort(key=lambda s: (not s["name"].startswith("step "), s["ts"]))  # steps underneath
    # Lanes of one family ("rollout 0", "rollout 1", ...) share a row in the picture.
    family = {tid: re.sub(r" \d+$", "", name) for tid, name in names.items()}
    rows = list(dict.fromkeys(family.get(t, str(t)) for t in sorted({s["tid"] for s in shown})))
    row = {tid: rows.index(family.get(tid, str(tid))) for tid in {s["tid"] for s in shown}}
    figure = new_figure(14, 0.6 * len(rows) + 1.8)
    ax = figure.subplots()
    from matplotlib.patches import Patch

    kinds: dict[str, None] = {}  # the span kinds drawn, in order, for the legend
    for span in shown:
        left = (max(span["ts"], start) - start) / 1e3
        width = (min(span["ts"] + span["dur"], end) - max(span["ts"], start)) / 1e3
        depth = 0.8 if span["name"].startswith("step") else 0.6  # a step's transitions drawn on top
        ax.broken_barh(
            [(left, max(width, 0.01))],
            (row[span["tid"]] - depth / 2, depth),
            facecolors=_colour(span["name"]),
            edgecolors="#555555",
            linewidth=0.3,
        )
        kinds.setdefault(span["name"].split()[0], None)
        first_lane = names.get(span["tid"], "") in (rows[row[span["tid"]]], f"{rows[row[span['tid']]]} 0")
        label = span["name"].split()[0] if span["name"].startswith(("generate", "score")) else span["name"]
        # A step's label sits above its transitions' (which cover the step's middle); any label
        # only where its bar has room for it, so none overlaps another or runs off the axes.
        on_top = span["name"].startswith("step ")
        # A frozen span sits inside its request's, whose label covers it: the legend names it.
        fits = len(label) * _CHAR_WIDTH * (end - start) / 1e3 < width * 0.9
        if first_lane and fits and span["name"] != "frozen":
            ax.text(
                left + width / 2,
                row[span["tid"]] - (0.3 if on_top else 0),
                label,
                ha="center",
                va="center",
                fontsize=6,
                clip_on=True,
            )
    ax.legend(
        handles=[Patch(facecolor=_colour(kind), edgecolor="#555555", label=kind) for kind in kinds],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.22),
        ncol=len(kinds),
        fontsize=7,
        frameon=False,
    )
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlim(0, (end - start) / 1e3)
    ax.set_xlabel("milliseconds")
    ax.set_title(f"{run_dir.resolve().name}: trace.json")
    ax.grid(axis="x", alpha=0.3)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    return out
