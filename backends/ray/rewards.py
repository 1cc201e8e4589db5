"""The reward stage's scoring function over a pool of reward-worker actors.

`RewardPool.score(pairs)` has `pipeline.rewards.scoring.score_all`'s contract (one group's (prompt, text)
pairs in, one result or exception per pair out) and sends the group to the worker with the
fewest groups in hand; each worker scores up to its actor's concurrency at once. A worker that
dies is replaced by a new actor (`backends/ray/workers.py`) and the groups it held are scored
again there (counted: `reward_worker_restarts`, `rescored_groups`). A deadline (`reward.reward_s`)
or a stop that cancels the wait also cancels the actor's task.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio
import ray

from backends.ray.lost import ACTOR_LOST
from backends.ray.workers import WorkerPool


class RewardPool(WorkerPool):
    def __init__(self, spawn: Callable[[], tuple[Any, int]], workers: int, *, counts: Counter[str]) -> None:
        super().__init__(
            spawn, workers, counts=counts, kind="a reward worker", counter="reward_worker_restarts"
        )

    async def score(self, pairs: list[tuple[Any, str | None]]) -> list[Any]:
        while True:
            worker = self.least_busy()
            incarnation = worker.take()
            ref = worker.actor.score.remote(pairs)
            try:
                return await ref  # type: ignore[no-any-return]
            except ACTOR_LOST as error:
                await self.replace(worker, incarnation, error)
                self.counts["rescored_groups"] += 1
            except anyio.get_cancelled_exc_class():
                ray.cancel(ref)
                raise
            finally:
                worker.release(incarnation)
