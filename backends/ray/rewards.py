"""The reward stage's scoring function over a pool of reward-worker actors.

`RewardPool.score(pairs)` has `pipeline.rewards.scoring.score_all`'s contract (one group's (prompt, text)
pairs in, one result or exception per pair out) and sends the group to the worker with the
fewest groups in hand; each worker scores up to its actor's concurrency at once. A worker that
dies is replaced by a new actor and the groups it held are scored again there (counted:
`reward_worker_restarts`, `rescored_groups`). A deadline (`reward.reward_s`) or a stop that
cancels the wait also cancels the actor's task.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio
import ray

from backends.ray.lost import ACTOR_LOST, cause

log = logging.getLogger("backends.ray.rewards")


class _Worker:
    def __init__(self, actor: Any, pid: int) -> None:
        self.actor = actor
        self.pid = pid
        self.incarnation = 0
        self.in_hand = 0
        self.restart = anyio.Lock()


class RewardPool:
    def __init__(self, spawn: Callable[[], tuple[Any, int]], workers: int, *, counts: Counter[str]) -> None:
        """`spawn()` starts one worker actor, blocking until it is up: (actor, its pid)."""
        self.spawn = spawn
        self.workers = [_Worker(*spawn()) for _ in range(workers)]
        self.counts = counts

    async def score(self, pairs: list[tuple[Any, str | None]]) -> list[Any]:
        while True:
            worker = min(self.workers, key=lambda w: w.in_hand)
            incarnation = worker.incarnation
            worker.in_hand += 1
            ref = worker.actor.score.remote(pairs)
            try:
                return await ref  # type: ignore[no-any-return]
            except ACTOR_LOST as error:
                await self._replace(worker, incarnation, error)
                self.counts["rescored_groups"] += 1
            except anyio.get_cancelled_exc_class():
                ray.cancel(ref)
                raise
            finally:
                worker.in_hand -= 1

    async def _replace(self, worker: _Worker, incarnation: int, error: BaseException) -> None:
        async with worker.restart:
            if worker.incarnation != incarnation:  # another group saw the same death first
                return
            log.warning("a reward worker died (%s); starting a new one", cause(error))
            ray.kill(worker.actor)  # unreachable is not always dead: it must not come back
            worker.actor, worker.pid = await anyio.to_thread.run_sync(self.spawn)
            worker.incarnation += 1
            self.counts["reward_worker_restarts"] += 1
