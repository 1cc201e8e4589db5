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

An environment that makes a synchronous call on its worker's event loop holds every episode of
that worker meanwhile (their calls fail by `env_s`, which the controller keeps: it is not on
that loop). A call cut off asks the worker, on a loop of its own, how long its environments'
loop has been held; past `BLOCKED_S`, one warning says so, naming the worker. The worker is
kept: the held call ends in its own time (a cancel cannot interrupt it).
"""

from __future__ import annotations

import itertools
import logging
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
from pipeline.logs import warn_once

log = logging.getLogger("backends.ray.environments")
BLOCKED_S = 1.0  # an environment's synchronous call this long has stalled its worker
PROBE_S = 1.0  # for a worker's answer on how long its loop has been held


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
            with anyio.CancelScope(shield=True), anyio.move_on_after(PROBE_S):
                await self._held(worker, actor)
            raise

    @staticmethod
    async def _held(worker: Worker, actor: Any) -> None:
        """For a call cut off (by `env_s`, or a stop): warn if an environment holds its worker's
        event loop with a synchronous call, which stalls every episode there."""
        try:
            held = await actor.blocked_for.remote()
        except ray.exceptions.RayError:
            return  # a dead worker: the calls that see its death report it
        if held > BLOCKED_S:
            warn_once(
                log,
                "blocked environment worker",
                "an environment has held its worker's event loop (pid %d) for %.1f s in one "
                "synchronous call: every episode on that worker waits meanwhile, and fails by "
                "rollout.env_s; make blocking calls in a thread (await asyncio.to_thread(...))",
                worker.pid,
                held,
            )
