"""The watchdog: names a stage that has made no progress for `stall_s`.

Stages call `beat(stage)` whenever they make progress and wrap waits in
`waiting(stage, what)`, so a stall report says what the stage waits on. The watchdog checks on
the wall clock (stalls are about the real world, so the gate's suspensions do not pause it) and
either logs a warning or, with `fail=True`, raises `StallError` naming the stage.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from pipeline.clock import TimeSource
from pipeline.contracts.errors import StallError

log = logging.getLogger("pipeline.watchdog")


class Watchdog:
    def __init__(self, source: TimeSource, *, stall_s: float, fail: bool) -> None:
        self.source = source
        self.stall_s = stall_s
        self.fail = fail
        self._last: dict[str, float] = {}
        self._waiting_on: dict[str, str] = {}
        self._done: set[str] = set()
        self._reported: set[str] = set()

    def register(self, stage: str) -> None:
        self._last[stage] = self.source.now()

    def beat(self, stage: str) -> None:
        self._last[stage] = self.source.now()
        self._reported.discard(stage)

    def done(self, stage: str) -> None:
        self._done.add(stage)

    @contextmanager
    def waiting(self, stage: str, what: str) -> Iterator[None]:
        self._waiting_on[stage] = what
        try:
            yield
        finally:
            self._waiting_on.pop(stage, None)
            self.beat(stage)

    def stalled(self) -> list[tuple[str, float, str]]:
        """(stage, seconds without progress, what it waits on) for every stalled stage."""
        now = self.source.now()
        return [
            (stage, now - last, self._waiting_on.get(stage, "its own work"))
            for stage, last in self._last.items()
            if stage not in self._done and now - last >= self.stall_s
        ]

    async def run(self) -> None:
        while True:
            await self.source.sleep(self.stall_s / 4)
            for stage, idle, what in self.stalled():
                message = f"stage {stage!r} made no progress for {idle:.0f} s; it waits on {what}"
                if self.fail:
                    raise StallError(message + " (watchdog.fail is true, stopping the run)")
                if stage not in self._reported:
                    self._reported.add(stage)
                    log.warning(message)
