"""How far the run is: steps done, batches admitted, and whether another batch is needed."""

from __future__ import annotations

import anyio


class Progress:
    """Shared between the prompt stage (admits) and the train stage (completes).

    A batch that ends empty (every group dropped) trains nothing, so another batch is needed
    to reach `steps` optimizer steps; `wait_batch_needed` accounts for that. `stop()` makes it
    answer False from then on (a clean stop admits nothing new).
    """

    def __init__(self, *, steps: int, steps_done: int = 0, empty_batches: int = 0) -> None:
        self.steps = steps
        self.steps_done = steps_done
        self.admitted = 0
        self.finished_batches = 0
        self.empty_batches = empty_batches  # over the whole run, resumes included
        self.stopped = False
        self._changed = anyio.Event()

    def _pending_nonempty(self) -> int:
        return self.admitted - self.finished_batches

    def batch_needed(self) -> bool:
        return not self.stopped and self.steps_done + self._pending_nonempty() < self.steps

    async def wait_batch_needed(self) -> bool:
        while not self.batch_needed():
            if self.stopped or self.steps_done >= self.steps:
                return False
            await self._changed.wait()
        return True

    def batch_admitted(self) -> None:
        self.admitted += 1

    def batch_finished(self, *, trained: bool) -> None:
        self.finished_batches += 1
        if trained:
            self.steps_done += 1
        else:
            self.empty_batches += 1
        self._notify()

    @property
    def done(self) -> bool:
        return self.steps_done >= self.steps

    def stop(self) -> None:
        self.stopped = True
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()
