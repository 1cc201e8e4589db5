"""Asynchronous checkpoint saves: the step waits for a snapshot, a background thread writes.

`CheckpointWriter.save(...)` (awaited inside the train step) first waits for the previous
checkpoint's write if it is still running (at most one write in flight: a part's snapshot
buffers are reused by its next snapshot), then takes the snapshot (`Checkpointer.snapshot`, on
a worker thread) and starts the write (`Checkpointer.write`: files, fsync, checksums, the commit
marker, the rename, retention) on a thread of its own, and returns. The write's guarantees are
the `Checkpointer`'s: a kill at any moment of it leaves the previous committed checkpoint as the
one resume uses, and retention runs only once the new one is committed.

A write that fails keeps its `CheckpointError` (nothing of it committed); `check()` raises it,
so the train stage stops the run at its next step, and so do the next `save` and `drain()`.
`drain()` waits for the write in flight (the final save and a clean stop call it before the run
ends); `settle()` only waits, raising nothing (a run already failing). `figures()` gives, once
each, what the step waited for the previous write (`timing/save_wait_s`, on every step that
saves: 0 when none was in flight) and how long the writes finished since the last call took
(`timing/save_write_s`); each write is also a span on the trace's `checkpoint` track. The thread
is not a daemon: an interpreter exiting without a drain still finishes the commit first.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import anyio
import msgspec

from pipeline.contracts.protocols import Checkpointable
from pipeline.trace import Trace
from stages.checkpoint import Checkpointer, Pending, PipelineState

log = logging.getLogger("stages.checkpoint")


class CheckpointWriter:
    def __init__(
        self,
        checkpointer: Checkpointer,
        *,
        now: Callable[[], float],
        trace: Trace,
    ) -> None:
        self.checkpointer = checkpointer
        self.now = now
        self.trace = trace
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._waited_s: float | None = None
        self._lock = threading.Lock()
        self._written: list[tuple[int, float, float]] = []  # (step, start, end), not yet reported
        self._write_s: float | None = None
        self.writes = 0  # writes started

    @property
    def writing(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def save(
        self,
        step: int,
        parts: Sequence[Checkpointable],
        state: PipelineState,
        recipe: msgspec.Struct,
        *,
        after_commit: Callable[[], None] = lambda: None,
    ) -> None:
        """Snapshot step `step` and start its write (then `after_commit()`, on the writer
        thread); returns once the snapshot is taken."""
        start = self.now()
        if self.writing:
            log.info("the save of step %d waits for the previous checkpoint's write", step)
        await self.settle()
        self._waited_s = self.now() - start
        self.check()
        pending = await anyio.to_thread.run_sync(self.checkpointer.snapshot, step, parts, state, recipe)
        self._thread = threading.Thread(
            target=self._write, args=(pending, after_commit), name=f"checkpoint-{step}"
        )
        self.writes += 1
        self._thread.start()

    def _write(self, pending: Pending, after_commit: Callable[[], None]) -> None:
        start = self.now()
        try:
            self.checkpointer.write(pending)
            after_commit()
        except BaseException as error:  # kept for the event loop, which raises it
            self._failure = error
        finally:
            with self._lock:
                self._written.append((pending.step, start, self.now()))

    def check(self) -> None:
        """Raise the failure of the last write, if it failed (once)."""
        failure, self._failure = self._failure, None
        if failure is None:
            return
        raise failure  # a CheckpointError, or a bug: raised as it is, with its traceback

    async def settle(self) -> None:
        """Wait for the write in flight, if any (never abandoned: a cancelled caller waits)."""
        thread = self._thread
        if thread is not None:
            await anyio.to_thread.run_sync(thread.join)
        self._report()

    async def drain(self) -> None:
        """Wait for the write in flight, then raise its failure."""
        await self.settle()
        self.check()

    def figures(self) -> dict[str, float]:
        figures: dict[str, float] = {}
        if self._waited_s is not None:
            figures["timing/save_wait_s"], self._waited_s = self._waited_s, None
        self._report()
        if self._write_s is not None:
            figures["timing/save_write_s"], self._write_s = self._write_s, None
        return figures

    def _report(self) -> None:
        """Add the writes finished since the last call to the trace (on the loop) and to the
        next `figures()`."""
        with self._lock:
            written, self._written = self._written, []
        for step, start, end in written:
            self.trace.span(f"write step {step}", start, end, track="checkpoint")
            self._write_s = (self._write_s or 0.0) + end - start
