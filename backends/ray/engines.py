"""The pipeline's `Engine` over engine replicas that are Ray actors.

Requests go to the replica with the fewest rows (samples) in flight; a request (a group's
samples) is never split. The requests that reach one replica
together (a batch's groups, started in the same few event-loop rounds) travel in one actor
call and are sampled in one batched call there. Each request has an id for its whole life.

Faults: when a replica's actor dies (its process killed, its node lost), the first request to
see it replaces the actor with a new one, loads the current weights into it (the package of
the last refit, still in the object store) and only then sends its requests again, with
the same ids; every other request of the lost call does the same. A request therefore
returns once, from the one replica that answered it: nothing is trained twice. Restarts and
re-dispatches are counted (`counts`); more than `max_restarts` restarts stop the run.

Versions: `refit` announces the trainer's next version, hands each replica the trainer's
package (which the replica checks on arrival, `backends/ray/weights.py`), or broadcasts the
weights to them all (`collective`, `backends/ray/collective.py`), and waits for all;
each answer says which versions the replica served, and one outside what was announced
between the request's dispatch and its answer fails the run (a replica serving weights it was
never sent).

Colocated, each replica is a trainer rank's own actor (one a data-parallel rank): stand-down and
wake go to every replica at once, the wake carries the weights, and an actor cannot be replaced
(its death is the trainer's): a stand-down or wake that fails on one fails the step, naming it.
The replicas' reports are combined: the memory they hold after a stand-down summed, their
fingerprints agreed (`_agreed`: a tensor on which they differ never matches the trainer's).
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter, deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import ray

from backends.ray.actors import Request
from backends.ray.lost import ACTOR_LOST, cause, unwrapped
from backends.ray.wire import decode_completions
from pipeline.contracts.errors import BackendLost, PipelineError
from pipeline.contracts.messages import Completion

if TYPE_CHECKING:
    from backends.ray.collective import Collective

log = logging.getLogger("backends.ray.engines")


class WrongVersion(RuntimeError):
    """A replica answered with weights of a version it was not sent: a bug."""


class _Lost(Exception):
    """The call's actor died; the request goes out again."""


_LOST = object()  # a lost call's answer to each of its requests


class Replica:
    """One engine actor and the requests queued for its next call."""

    def __init__(self, index: int, actor: Any, where: dict[str, Any]) -> None:
        self.index = index
        self.actor = actor
        self.where = where
        self.incarnation = 0
        self.in_flight = 0  # rows (samples) of the requests it holds
        self.calls = 0  # generate calls sent to it (each with a burst of requests)
        self.queue: list[tuple[Request, list[Any], anyio.Event]] = []
        self.sending = False
        self.ready = anyio.Event()  # cleared while the actor is being replaced
        self.ready.set()
        self.restart = anyio.Lock()


class RayEngine:
    def __init__(
        self,
        replicas: Sequence[Replica],
        *,
        spawn: Callable[[int], tuple[Any, dict[str, Any]]] | None,
        publish: Callable[[], Any] | None,
        colocated: bool,
        max_restarts: int,
        counts: Counter[str],
        collective: Collective | None = None,
    ) -> None:
        """`spawn(i)` makes replica i's actor anew, blocking (None: never replaced);
        `publish()` asks the trainer for its next weights: (version, package reference);
        `collective`: refits broadcast the weights instead (`placement.weights: collective`)."""
        self.replicas = list(replicas)
        self.spawn = spawn
        self.publish = publish
        self.collective = collective
        self.blocks_training = colocated
        self.wake_carries_weights = colocated
        self.max_restarts = max_restarts
        self.counts = counts
        self.version = 0  # every replica serves it (or, during a refit, it or the announced one)
        self.announced = 0
        # Reference of the weights every replica should serve; None after a broadcast, until a
        # replica replaced asks for them.
        self.package: Any = None
        self._ids = itertools.count()
        self._memory: int | None = None
        self._served: dict[str, int] | None = None
        # The latest ("dispatch" | "redispatch", request id, replica index), for tests and debugging.
        self.events: deque[tuple[str, int, int]] = deque(maxlen=100_000)

    async def generate(
        self, prompt_tokens: Sequence[int], n: int, *, greedy: bool = False, episode: str | None = None
    ) -> list[Completion]:
        """Send the request to the least busy replica; ``episode`` is ignored (an episode's
        turns may go to different replicas: each prefills its whole prompt)."""
        request: Request = (next(self._ids), tuple(prompt_tokens), n, greedy)
        kind = "dispatch"
        while True:
            replica = await self._pick()
            self.events.append((kind, request[0], replica.index))
            replica.in_flight += n
            try:
                result = await self._submit(replica, request)
            except _Lost:
                kind = "redispatch"
                self.counts["redispatched_requests"] += 1
                continue
            finally:
                replica.in_flight -= n
            if isinstance(result, BaseException):
                raise result
            return list(result)

    async def _pick(self) -> Replica:
        while True:
            ready = [r for r in self.replicas if r.ready.is_set()]
            if ready:
                return min(ready, key=lambda r: r.in_flight)
            await self.replicas[0].ready.wait()

    async def _submit(self, replica: Replica, request: Request) -> Any:
        """Queue `request` on `replica`; the first caller to find no call going out waits for
        the others of its burst, then sends them all in one call and hands out the answers."""
        slot: list[Any] = []
        done = anyio.Event()
        replica.queue.append((request, slot, done))
        if not replica.sending:
            replica.sending = True
            with anyio.CancelScope(shield=True):  # the others wait on this call's answer
                try:
                    for _ in range(2):  # the rest of the burst: groups started in the same rounds
                        await anyio.lowlevel.checkpoint()
                finally:
                    replica.sending = False
                batch, replica.queue = replica.queue, []
                await self._send(replica, batch)
        await done.wait()
        if slot[0] is _LOST:
            raise _Lost
        return slot[0]

    async def _send(self, replica: Replica, batch: list[tuple[Request, list[Any], anyio.Event]]) -> None:
        dispatched = self.version
        incarnation = replica.incarnation
        replica.calls += 1
        try:
            first, last, encoded, errors = await replica.actor.generate.remote(
                [request for request, _, _ in batch]
            )
        except ACTOR_LOST as error:
            for _, slot, done in batch:
                slot.append(_LOST)
                done.set()
            await self._replace(replica, incarnation, error)
            return
        if not dispatched <= first <= last <= self.announced:
            raise WrongVersion(
                f"engine replica {replica.index} served weights of versions {first}..{last}; "
                f"dispatched at {dispatched}, announced {self.announced}"
            )
        results = decode_completions(encoded)
        for index, ((_, slot, done), result) in enumerate(zip(batch, results, strict=True)):
            slot.append(errors.get(index, result))
            done.set()

    async def _replace(self, replica: Replica, incarnation: int, error: BaseException) -> None:
        """A new actor for `replica` (once per death, whoever sees it first), with the current weights."""
        async with replica.restart:
            if replica.incarnation != incarnation:
                return
            if self.spawn is None:
                raise BackendLost(f"the engine's actor (colocated with the trainer) died: {cause(error)}")
            if self.counts["engine_restarts"] >= self.max_restarts:
                raise PipelineError(
                    f"engine replica {replica.index} died ({cause(error)}) after "
                    f"{self.counts['engine_restarts']} restarts, placement.max_engine_restarts="
                    f"{self.max_restarts}: the run stops"
                )
            replica.ready = anyio.Event()
            log.warning(
                "engine replica %d (pid %s) died: %s; starting a new one",
                replica.index,
                replica.where.get("pid"),
                cause(error),
            )
            ray.kill(replica.actor)  # unreachable is not always dead: it must not come back
            replica.actor, replica.where = await anyio.to_thread.run_sync(self.spawn, replica.index)
            if self.package is None:  # the last refit was a broadcast: the trainer kept its weights
                assert self.collective is not None
                self.package = self.collective.package(self.announced)
            # The announced weights: a refit may be on its way.
            await replica.actor.set_weights.remote(self.announced, self.package)
            replica.incarnation += 1
            self.counts["engine_restarts"] += 1
            replica.ready.set()

    async def stand_down(self) -> None:
        memory = await self._every("stand_down")
        self._memory = None if any(m is None for m in memory) else sum(memory)

    async def wake(self) -> None:
        self._served = _agreed(await self._every("wake"))

    async def _every(self, method: str) -> list[Any]:
        """`method` on every (colocated) replica at once; their answers in replica order. A
        replica that died raises `BackendLost` naming it (the first one's, once all answered)."""
        answers: list[Any] = [None] * len(self.replicas)
        lost: list[BackendLost] = []

        async def one(replica: Replica) -> None:
            try:
                answers[replica.index] = await self._call(replica, method)
            except BackendLost as error:  # one error, not a group of one
                lost.append(error)

        async with anyio.create_task_group() as group:
            for replica in self.replicas:
                group.start_soon(one, replica)
        if lost:
            raise lost[0]
        return answers

    async def refit(self) -> None:
        assert self.publish is not None, "a colocated engine's wake carries the weights"
        if self.collective is not None:
            self.announced, self.package = self.collective.trainer.completed_steps, None
            served = await self.collective.refit(self.announced, self.replicas, self._replace)
        else:
            served = await self._refit_by_package()
        self.version = self.announced
        self._served = _agreed(served)

    async def _refit_by_package(self) -> list[dict[str, int] | None]:
        self.announced, self.package = self.publish()  # type: ignore[misc]
        served: list[dict[str, int] | None] = [None] * len(self.replicas)

        async def one(replica: Replica) -> None:
            while True:
                await replica.ready.wait()
                incarnation = replica.incarnation
                try:
                    served[replica.index] = await replica.actor.set_weights.remote(
                        self.announced, self.package
                    )
                    return
                except ACTOR_LOST as error:  # the new actor gets this package as it starts
                    await self._replace(replica, incarnation, error)

        async with anyio.create_task_group() as group:
            for replica in self.replicas:
                group.start_soon(one, replica)
        return served

    async def _call(self, replica: Replica, method: str) -> Any:
        try:
            return await getattr(replica.actor, method).remote()
        except ACTOR_LOST as error:
            which = (
                f"engine replica {replica.index}'s actor" if len(self.replicas) > 1 else "the engine's actor"
            )
            raise BackendLost(f"{which} (colocated with the trainer) died: {cause(error)}") from None

    def memory_in_use(self) -> int | None:
        return self._memory

    def fingerprint(self) -> dict[str, int] | None:
        return self._served

    def save(self, directory: Path) -> None:
        """Replica 0's files in `directory`, as an in-process engine's (so a checkpoint resumes
        under either placement); replica i's in `replica-<i>/`. Written by the actors, into
        storage their nodes see."""
        for replica in self.replicas[1:]:
            _replica_dir(directory, replica.index).mkdir()
        unwrapped(
            [r.actor.save.remote("engine", str(_replica_dir(directory, r.index))) for r in self.replicas]
        )

    def load(self, directory: Path) -> None:
        """Each replica's files (a replica the checkpoint has none for keeps its own seed), then,
        when not colocated, the weights the trainer loaded (the trainer loads first)."""
        unwrapped(
            [
                r.actor.load.remote("engine", str(_replica_dir(directory, r.index)))
                for r in self.replicas
                if _replica_dir(directory, r.index).is_dir()
            ]
        )
        if self.publish is not None:
            self.version, self.package = self.publish()
            self.announced = self.version
            self._served = _agreed(
                ray.get([r.actor.set_weights.remote(self.version, self.package) for r in self.replicas])
            )

    def close(self) -> None:
        """Nothing here: the placement kills the actors (`Placed.close`)."""


def _replica_dir(directory: Path, index: int) -> Path:
    return directory if index == 0 else directory / f"replica-{index}"


def _agreed(served: list[dict[str, int] | None]) -> dict[str, int] | None:
    """One fingerprint for all replicas: a tensor on which they disagree gets -1, which matches
    no trainer's checksum, so the gate's handoff check names it."""
    if any(s is None for s in served):
        return None
    first = served[0]
    assert first is not None
    return {name: value if all(s[name] == value for s in served) else -1 for name, value in first.items()}  # type: ignore[index]
