"""The run's timeline as a Chrome trace (`run.dir/trace.json`, opens in Perfetto or chrome://tracing).

Each track is one thread row. Spans on a track nest (the format requires it), so work that runs
concurrently (generation requests) gets `lanes`: a span takes the lowest free row of its track
family ("rollout 0", "rollout 1", ...) and frees it when done. Counters (queue depths, lag)
become graphs. Times come from the pipeline's time source, so tests on fake time get exact
traces. A long run keeps its most recent `max_events` events (the oldest quarter goes when the
cap is reached; `otherData.dropped_events` counts them), so memory and the file stay bounded.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec

_WRITE_CHUNK = 2_000  # events encoded at once by `Trace.write`


class Lane:
    """A lane span being recorded: `args` are added to it, `track` is its row."""

    def __init__(self, track: str) -> None:
        self.track = track
        self.args: dict[str, Any] = {}


class Trace:
    def __init__(self, now: Callable[[], float], *, max_events: int = 200_000) -> None:
        self.now = now
        self.origin = now()
        self.max_events = max_events
        self.dropped = 0
        self.metadata: list[dict[str, Any]] = []  # track names: never dropped
        self.events: list[dict[str, Any]] = []
        self._tids: dict[str, int] = {}
        self._busy: dict[str, set[int]] = {}

    def _tid(self, track: str) -> int:
        tid = self._tids.get(track)
        if tid is None:
            tid = self._tids[track] = len(self._tids) + 1
            self.metadata.append(
                {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": track}}
            )
            self.metadata.append(
                {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": tid, "args": {"sort_index": tid}}
            )
        return tid

    def _us(self, t: float) -> float:
        return round((t - self.origin) * 1e6, 3)

    def _add(self, event: dict[str, Any]) -> None:
        if len(self.events) >= self.max_events:
            cut = max(1, self.max_events // 4)
            del self.events[:cut]
            self.dropped += cut
        self.events.append(event)

    def span(self, name: str, start: float, end: float, *, track: str, **args: Any) -> None:
        self._add(
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
    def lane(self, family: str, name: str, **args: Any) -> Iterator[Lane]:
        """A span on the lowest free row of `family`; the yielded `Lane` adds args to it and
        names its row, for spans nested inside it."""
        busy = self._busy.setdefault(family, set())
        index = next(i for i in range(len(busy) + 1) if i not in busy)
        busy.add(index)
        start = self.now()
        lane = Lane(track=f"{family} {index}")
        try:
            yield lane
        finally:
            busy.discard(index)
            self.span(name, start, self.now(), track=lane.track, **args, **lane.args)

    def counters(self, name: str, values: dict[str, float]) -> None:
        """A counter sample (drawn as a graph per key) at the current time."""
        self._add({"name": name, "ph": "C", "ts": self._us(self.now()), "pid": 0, "tid": 0, "args": values})

    def snapshot(self) -> dict[str, Any]:
        """The trace as a Chrome trace object (a copy: safe to write from another thread)."""
        return {
            "traceEvents": [*self.metadata, *self.events],
            "displayTimeUnit": "ms",
            "otherData": {"dropped_events": self.dropped},
        }

    def write(self, path: Path, snapshot: dict[str, Any] | None = None) -> None:
        """Write atomically: a crash mid-write never leaves a torn trace."""
        snapshot = snapshot if snapshot is not None else self.snapshot()
        events = snapshot["traceEvents"]
        rest = msgspec.json.encode({k: v for k, v in snapshot.items() if k != "traceEvents"})
        tmp = path.with_suffix(".json.tmp")
        with tmp.open("wb") as out:
            out.write(b'{"traceEvents":[')
            # An encode holds the GIL throughout (a full trace: 0.16 s), stalling the event loop
            # even from a thread; a chunk at a time lets the loop in between (1-2 ms each).
            for start in range(0, len(events), _WRITE_CHUNK):
                out.write(b"," if start else b"")
                out.write(msgspec.json.encode(events[start : start + _WRITE_CHUNK])[1:-1])
            out.write(b"]," + rest[1:] if len(rest) > 2 else b"]}")
        os.replace(tmp, path)
