"""A pool of worker actors of one kind (reward workers, environment workers): the least busy
one takes the next piece of work, and one that died is replaced by a new actor.

Each `Worker` counts the work it holds (`in_hand`: `take` and `release`) and its `incarnation`,
raised each time its actor is replaced; a caller notes the incarnation it sent work to, so that
several callers that see the same death replace the actor once (`replace`), and work the dead
actor held is no longer counted against the new one. The replaced actor is killed first (an
unreachable actor is not always dead: it must not come back), the new one started on a worker
thread (starting blocks until it is up), and `counts[counter]` raised.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio
import ray

from backends.ray.lost import cause

log = logging.getLogger("backends.ray.workers")


class Worker:
    def __init__(self, actor: Any, pid: int) -> None:
        self.actor = actor
        self.pid = pid
        self.incarnation = 0
        self.in_hand = 0
        self.restart = anyio.Lock()

    def take(self) -> int:
        """Count one more piece of work in hand; the incarnation it goes to."""
        self.in_hand += 1
        return self.incarnation

    def release(self, incarnation: int) -> None:
        """Work taken for `incarnation` is done (not counted if that actor was replaced)."""
        if incarnation == self.incarnation:
            self.in_hand -= 1


class WorkerPool:
    def __init__(
        self,
        spawn: Callable[[], tuple[Any, int]],
        workers: int,
        *,
        counts: Counter[str],
        kind: str,
        counter: str,
    ) -> None:
        """`spawn()` starts one worker actor, blocking until it is up: (actor, its pid); `kind`
        names the workers in the log, `counter` is the count of replacements in `counts`."""
        self.spawn = spawn
        self.workers = [Worker(*spawn()) for _ in range(workers)]
        self.counts = counts
        self.kind = kind
        self.counter = counter

    def least_busy(self) -> Worker:
        return min(self.workers, key=lambda w: w.in_hand)

    async def replace(self, worker: Worker, incarnation: int, error: BaseException) -> None:
        """Replace `worker`'s actor, which died under work sent to its `incarnation` (nothing to
        do when another caller replaced it already)."""
        async with worker.restart:
            if worker.incarnation != incarnation:
                return
            log.warning("%s died (%s); starting a new one", self.kind, cause(error))
            ray.kill(worker.actor)
            worker.actor, worker.pid = await anyio.to_thread.run_sync(self.spawn)
            worker.incarnation += 1
            worker.in_hand = 0  # what the dead actor held is lost with it
            self.counts[self.counter] += 1
