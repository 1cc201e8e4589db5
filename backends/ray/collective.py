"""The `collective` weights transport (`placement.weights: collective`), on the controller's
side: who is in the process group, and each refit's calls (the actors' side is
`backends/ray/broadcast.py`).

The group is the trainer's actor (rank 0) and every replica's current actor (rank 1 + its
index). It is built at the first refit, and again whenever the membership changed (a replica
replaced): every member leaves the old group and joins the new one. A replica replaced between
two refits loads the last broadcast's weights from the object store (`package`: the trainer's
kept buckets, copied once for all restarts of that version) and joins the group at the next
refit. A replica that dies during a refit fails that attempt for every member (the broadcast
cannot finish without its rank: the others' calls end in an error, at the latest after
`placement.collective_timeout_s`);
once every call has ended, the replica is replaced and the refit starts again in a new group.
The trainer's death stops the run.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from backends.ray.lost import ACTOR_LOST, cause

if TYPE_CHECKING:
    from backends.ray.engines import Replica
    from backends.ray.trainer import RayTrainer

log = logging.getLogger("backends.ray.collective")
# Replaces a replica whose actor died: (replica, its incarnation when the call went out, error).
Replace = Callable[["Replica", int, BaseException], Awaitable[None]]


class Collective:
    def __init__(self, trainer: RayTrainer, backend: str, timeout_s: float) -> None:
        """`backend`: torch.distributed's, "nccl" (every actor on a GPU of its own) or "gloo";
        `timeout_s`: how long a member's collective waits on another before it fails."""
        self.trainer = trainer
        self.backend = backend
        self.timeout_s = timeout_s
        self.members: tuple[int, ...] | None = None  # the replicas' incarnations in the group
        self.builds = 0
        self.attempts = 0  # refits tried again after a replica died during one

    @property
    def actor(self) -> Any:
        return self.trainer.ranks[0][0]

    async def refit(
        self, version: int, replicas: Sequence[Replica], replace: Replace
    ) -> list[dict[str, int] | None]:
        """Broadcast the trainer's weights as `version` to every replica; their fingerprints."""
        while True:
            # The members as of now, all up (one being replaced joins once it is): each call
            # goes to the actor of the incarnation it is recorded with.
            while not all(r.ready.is_set() for r in replicas):
                await next(r for r in replicas if not r.ready.is_set()).ready.wait()
            members = [(r, r.incarnation, r.actor) for r in replicas]
            try:
                if self.members != tuple(i for _, i, _ in members):
                    self.members = None  # until every member has joined
                    await self._build(members)
                    self.members = tuple(i for _, i, _ in members)
                    self.builds += 1
                if any(r.incarnation != i for r, i, _ in members):
                    continue  # replaced while the group was built: build it again
                return await self._all(
                    f"the weight broadcast of version {version}",
                    self.actor.send_weights.remote(version),
                    [(r, i, actor.receive_weights.remote(version)) for r, i, actor in members],
                )
            except _ReplicasLost as lost:
                for replica, incarnation, error in lost.replicas:
                    await replace(replica, incarnation, error)
                self.attempts += 1

    async def _build(self, members: list[tuple[Replica, int, Any]]) -> None:
        address = await self.actor.open_group.remote(self.timeout_s)
        world = 1 + len(members)
        await self._all(
            "the rebuild of the weights' process group",
            self.actor.join_group.remote(address, 0, world, self.backend, self.timeout_s),
            [
                (r, i, actor.join_group.remote(address, 1 + r.index, world, self.backend, self.timeout_s))
                for r, i, actor in members
            ],
        )

    def package(self, version: int) -> Any:
        """Reference of an object-store package of the last broadcast's weights (`version`)."""
        return self.actor.kept_weights.remote(version)

    async def _all(self, what: str, trainer: Any, replicas: list[tuple[Replica, int, Any]]) -> list[Any]:
        """Await the trainer's call and every replica's (a collective needs all of them at once);
        the replicas' answers. Every call ends before this returns or raises `_ReplicasLost`:
        a replica's death makes the others fail, and those errors are its consequence."""
        answers: list[Any] = [None] * len(replicas)
        lost: list[tuple[Replica, int, BaseException]] = []
        failed: list[BaseException] = []

        async def one(replica: Replica | None, incarnation: int, call: Any) -> None:
            try:
                answer = await call
            except ACTOR_LOST as error:
                if replica is None:
                    raise self.trainer.lost(0, f"during {what}", error) from None
                lost.append((replica, incarnation, error))
                return
            except Exception as error:  # a member's failure, or the consequence of a death
                failed.append(error)
                return
            if replica is not None:
                answers[replica.index] = answer

        async with anyio.create_task_group() as group:
            group.start_soon(one, None, 0, trainer)
            for replica, incarnation, call in replicas:
                group.start_soon(one, replica, incarnation, call)
        if lost:
            if failed:
                log.warning("the other members' calls ended with: %s", "; ".join(cause(e) for e in failed))
            raise _ReplicasLost(lost)
        if failed:
            raise failed[0]
        return answers


class _ReplicasLost(Exception):
    def __init__(self, replicas: list[tuple[Replica, int, BaseException]]) -> None:
        self.replicas = replicas
