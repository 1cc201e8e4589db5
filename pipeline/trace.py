"""Stage spans and gate transitions as a Chrome trace (`trace.json`, opens in Perfetto)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class Trace:
    def __init__(self, origin: float) -> None:
        self.origin = origin
        self.events: list[dict[str, Any]] = []

    def span(self, name: str, start: float, end: float, *, track: str, **args: Any) -> None:
        self.events.append(
            {
                "name": name,
                "ph": "X",
                "ts": (start - self.origin) * 1e6,
                "dur": (end - start) * 1e6,
                "pid": 0,
                "tid": track,
                "args": args,
            }
        )

    def write(self, path: Path) -> None:
        path.write_text(json.dumps({"traceEvents": self.events, "displayTimeUnit": "ms"}))
