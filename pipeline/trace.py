"""The run's timeline as a Chrome trace (`run.dir/trace.json`, opens in Perfetto or chrome://tracing).

Each track is one thread row. Spans on a track nest (the format requires it), so work that runs
concurrently (generation requests) gets `lanes`: a span takes the lowest free row of its track
family ("rollout 0", "rollout 1", ...) and frees it when done. Counters (queue depths, lag)
become graphs. Times come from the pipeline's time source, so tests on fake time get exact
traces.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class Trace:
    def __init__(self, now: Callable[[], float]) -> None:
        self.now = now
        self.origin = now()
        self.events: list[dict[str, Any]] = []
        self._tids: dict[str, int] = {}
        self._busy: dict[str, set[int]] = {}

    def _tid(self, track: str) -> int:
        tid = self._tids.get(track)
        if tid is None:
            tid = self._tids[track] = len(self._tids) + 1
            self.events.append(
                {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": track}}
            )
            self.events.append(
                {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": tid, "args": {"sort_index": tid}}
            )
        return tid

    def _us(self, t: float) -> float:
        return round((t - self.origin) * 1e6, 3)

    def span(self, name: str, start: float, end: float, *, track: str, **args: Any) -> None:
        self.events.append(
            {
                "name": name,
                "ph": "X",
                "ts": self._us(start),
                "dur": max(0.0, self._us(end) - self._us(start)),
                "pid": 0,
                "tid": self._tid(track),
                "args": args,
            }
        )

    @contextmanager
    def lane(self, family: str, name: str, **args: Any) -> Iterator[dict[str, Any]]:
        """A span on the lowest free row of `family`; the yielded dict adds args to it."""
        busy = self._busy.setdefault(family, set())
        index = next(i for i in range(len(busy) + 1) if i not in busy)
        busy.add(index)
        start = self.now()
        extra: dict[str, Any] = {}
        try:
            yield extra
        finally:
            busy.discard(index)
            self.span(name, start, self.now(), track=f"{family} {index}", **args, **extra)

    def counters(self, name: str, values: dict[str, float]) -> None:
        """A counter sample (drawn as a graph per key) at the current time."""
        self.events.append(
            {"name": name, "ph": "C", "ts": self._us(self.now()), "pid": 0, "tid": 0, "args": values}
        )

    def write(self, path: Path) -> None:
        """Write atomically: a crash mid-write never leaves a torn trace."""
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"traceEvents": self.events, "displayTimeUnit": "ms"}))
        os.replace(tmp, path)
