"""Multi-turn environments on a pool of environment-worker actors (`placement.environment_workers`).

`EnvironmentPool.environment()` is the rollout's environment factory (`rollout.environment`'s
contract, `pipeline.contracts.environments`): each call returns a `RemoteEnvironment`, the
controller's handle on one episode's environment, which is built and run in the worker with the
fewest episodes in hand when the episode starts, and stays there until it ends (`close`).

The rollout awaits its calls as it awaits an environment in the controller, under the same
`rollout.env_s` and failure budget, and sees the same failures: what the environment raised
(Ray's wrapping taken off), its answer as it was. A call cut off by its deadline, or by a stop,
cancels the actor's task too. A worker that dies fails the episodes it held, each with one line
(`EnvironmentWorkerLost`, counted against `rollout.max_env_failures` as any environment
failure), and is replaced by a new actor for the episodes after (`environment_worker_restarts`);
an episode whose start found it dead starts once more on the new one.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio
import ray
import ray.exceptions

from backends.ray.lost import ACTOR_LOST, cause
from backends.ray.workers import Worker, WorkerPool
from pipeline.contracts.environments import Observation, Turn
from pipeline.contracts.messages import Prompt


class EnvironmentWorkerLost(RuntimeError):
    """The environment-worker actor holding an episode's environment died."""


class EnvironmentPool(WorkerPool):
    def __init__(self, spawn: Callable[[], tuple[Any, int]], workers: int, *, counts: Counter[str]) -> None:
        super().__init__(
            spawn, workers, counts=counts, kind="an environment worker", counter="environment_worker_restarts"
        )
        self.keys = itertools.count()

    def environment(self) -> RemoteEnvironment:
        """One episode's environment (the rollout's factory)."""
        return RemoteEnvironment(self, next(self.keys))


class RemoteEnvironment:
    """One episode's environment, held by a worker of `pool` from `start` to `close`."""

    def __init__(self, pool: EnvironmentPool, key: int) -> None:
        self.pool = pool
        self.key = key
        self.held: tuple[Worker, Any, int] | None = None  # worker, its actor then, incarnation

    async def start(self, prompt: Prompt) -> Observation:
        """Build and start the environment in the least busy worker; a worker found dead is
        replaced and the start sent once more (the episode had nothing there to lose yet)."""
        for attempt in range(2):
            worker = self.pool.least_busy()
            self.held = (worker, worker.actor, worker.take())
            try:
                return await self._call("start", prompt)
            except EnvironmentWorkerLost:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def step(self, turn: Turn) -> Observation:
        return await self._call("step", turn)

    def close(self) -> None:
        if self.held is None:
            return
        worker, actor, incarnation = self.held
        self.held = None
        if worker.incarnation == incarnation:  # a replaced actor took the environment with it
            actor.close.remote(self.key)
            worker.release(incarnation)

    async def _call(self, method: str, argument: Any) -> Observation:
        assert self.held is not None, "start comes first"
        worker, actor, incarnation = self.held
        ref = getattr(actor, method).remote(self.key, argument)
        try:
            return await ref  # type: ignore[no-any-return]
        except ray.exceptions.RayTaskError as error:
            raise error.cause from None  # the environment's own exception, as in the controller
        except ACTOR_LOST as error:
            await self.pool.replace(worker, incarnation, error)
            raise EnvironmentWorkerLost(f"its environment worker died ({cause(error)})") from None
        except anyio.get_cancelled_exc_class():
            ray.cancel(ref)
            raise
