"""The terminal view of a run.

On a terminal: a status line at the bottom, redrawn twice a second while the run works (step,
reward, loss, lag, tokens/s, ETA, queue depths, gate state), with a permanent line every
`log_every` steps and at each evaluation; log records are printed above it. Anywhere else (CI,
a file): the same permanent lines, plain, and nothing redrawn.

The status line is cut to the terminal's width: a line that wraps cannot be erased by `\r`,
and each redraw would leave a copy behind. Permanent lines (and log records printed above the
status line) are wrapped to it instead, between fields where they can be, the rest indented, so
nothing is lost and nothing is left to the terminal to break mid-figure; where the width is
unknown (not a terminal, no `COLUMNS`) it is 80. The ETA is the steps left times the median of the
last steps' durations, so the slow first steps (and an evaluation's step) do not inflate it.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TextIO

import anyio

from pipeline.logs import DATE_FORMAT, NARRATION

# (record key, label, format)
_FIELDS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("env/turns_mean", "turns", "{:.2f}"),  # multi-turn runs only
    ("train/loss", "loss", "{:+.4f}"),
    ("rollout/max_lag", "lag", "{}"),
    ("throughput/tokens_per_s_per_gpu", "tok/s", "{:,.0f}"),
    ("timing/step_s", "s/step", "{:.3f}"),
)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


_INDENT = "    "  # a wrapped line's continuation


def _wrap(text: str, width: int) -> list[str]:
    """`text` as lines of at most `width` columns: broken after a whole field (fields are two
    spaces apart) where one ends in the line's second half, else at a space, else anywhere."""
    lines: list[str] = []
    for physical in text.splitlines() or [""]:
        rest, prefix = physical, ""
        while len(prefix) + len(rest) > width:
            room = max(width - len(prefix), 1)
            cut = rest.rfind("  ", 0, room + 1)
            if cut < room // 2:
                cut = rest.rfind(" ", 0, room + 1)
            if cut <= 0:
                cut = room
            lines.append(prefix + rest[:cut].rstrip())
            rest, prefix = rest[cut:].lstrip(), _INDENT
        lines.append(prefix + rest)
    return lines


def _fit(text: str, width: int) -> str:
    """`text` cut to `width` columns after its last whole field (fields are two spaces apart)."""
    if len(text) <= width:
        return text
    end = text.rfind("  ", 0, width + 2)
    return text[:end] if end > 0 else text[:width]


class Console:
    def __init__(
        self,
        total_steps: int,
        *,
        stream: TextIO | None = None,
        live: bool | None = None,
        log_every: int = 10,
        now: Callable[[], float] = time.monotonic,
        width: Callable[[], int] = lambda: shutil.get_terminal_size().columns,
    ) -> None:
        self.total = total_steps
        self.stream = stream if stream is not None else sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.log_every = log_every
        self.now = now
        self.width = width
        self.last: dict[str, Any] = {}
        self.last_eval: dict[str, Any] = {}
        self.state: dict[str, Any] = {}
        self._step_times: deque[tuple[int, float]] = deque(maxlen=11)  # ten durations
        self._shown = ""
        # Log records may arrive from worker threads (a reward function's warnings) while the
        # event loop redraws: one writer at a time, or the lines interleave.
        self._writing = threading.RLock()
        self._closed = False

    # -- what the pipeline reports ------------------------------------------------------------

    def record(self, record: dict[str, Any]) -> None:
        """A train step's metrics record."""
        self.last = record
        step = int(record.get("step", 0))
        self._step_times.append((step, self.now()))
        if step % self.log_every == 0 or step in (1, self.total):
            self.line(self._summary(with_eval=False))
        else:
            self._redraw()

    def evaluation(self, record: dict[str, Any]) -> None:
        self.last_eval = record
        parts = [f"eval @ step {record.get('step', '?')}"]
        parts += [
            f"{key[len('eval/') :]} {value:.3f}" for key, value in record.items() if key.startswith("eval/")
        ]
        self.line("  ".join(parts))

    def observe(self, state: dict[str, Any]) -> None:
        """Live state between steps: `gate` (its state) and `queues` (name -> depth)."""
        self.state = state
        self._redraw()

    async def refresh(self, snapshot: Callable[[], dict[str, Any]], period: float = 0.5) -> None:
        """Redraw the status line from `snapshot()` every `period` seconds (live only)."""
        if not self.live:
            return
        while True:
            self.observe(snapshot())
            await anyio.sleep(period)

    def line(self, text: str) -> None:
        """A permanent line (above the status line when live), wrapped to the width."""
        with self._writing:
            self._clear()
            self.stream.write("".join(line + "\n" for line in _wrap(text, max(self.width(), 1))))
            if not self.live:
                self.stream.flush()  # a pipe or a file sees each line as it is made, not in bursts
            self._redraw()

    def close(self) -> None:
        """Clear the status line; later lines (late log records) print plainly."""
        with self._writing:
            self._clear()
            self._closed = True
            self.stream.flush()

    # -- drawing ------------------------------------------------------------------------------

    def eta_s(self) -> float | None:
        times = list(self._step_times)
        durations = [
            (t - t0) / (step - step0) for (step0, t0), (step, t) in itertools.pairwise(times) if step > step0
        ]
        if not durations:
            return None
        return (self.total - times[-1][0]) * statistics.median(durations)

    def _summary(self, *, with_eval: bool = True) -> str:
        record = self.last
        parts = [f"step {record.get('step', 0)}/{self.total}"]
        for key, label, form in _FIELDS:
            if key in record:
                parts.append(f"{label} {form.format(record[key])}")
        eta = self.eta_s()
        if eta is not None:
            parts.append(f"ETA {_duration(eta)}")
        if with_eval and "eval/reward" in self.last_eval:
            parts.append(f"eval {self.last_eval['eval/reward']:.3f}")
        queues = self.state.get("queues") or {
            key[len("queue/") :]: value for key, value in record.items() if key.startswith("queue/")
        }
        if queues:
            parts.append("queues " + " ".join(f"{name} {depth}" for name, depth in queues.items()))
        if "gate" in self.state:
            parts.append(f"gate {self.state['gate']}")
        return "  ".join(parts)

    def _redraw(self) -> None:
        if not self.live or self._closed:
            return
        with self._writing:
            # One column spare: a line that fills the last column leaves some terminals'
            # cursor waiting to wrap.
            self._shown = _fit(self._summary(), max(self.width() - 1, 1))
            self.stream.write("\r\x1b[2K" + self._shown)
            self.stream.flush()

    def _clear(self) -> None:
        if self.live and self._shown:
            self.stream.write("\r\x1b[2K")
            self._shown = ""


class ConsoleHandler(logging.Handler):
    """Prints log records above a live status line instead of through it; start-up's narration
    (`pipeline.startup`) as its time and message alone, like the console's own lines."""

    def __init__(self, console: Console) -> None:
        super().__init__()
        self.console = console
        self._narration = logging.Formatter("%(asctime)s %(message)s", DATE_FORMAT)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            narrated = record.name == NARRATION
            self.console.line(self._narration.format(record) if narrated else self.format(record))
        except Exception:
            self.handleError(record)
