"""The `collective` weights transport (`placement.weights: collective`), on the controller's
side: who is in the process group, and each refit's calls (the actors' side is
`backends/ray/broadcast.py`).

The group is the trainer's actor (rank 0) and every replica's current actor (rank 1 + its
index). It is built at the first refit, and again at the first refit after a replica was
replaced (a membership change: every member leaves the old group and joins the new one). A
replica replaced between two refits loads the last broadcast's weights from the object store
(`package`: the trainer's kept buckets, copied once for all restarts of that version) and
joins the group at the next refit. A member that dies during a broadcast stops the run: the
others cannot finish it without that rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio

from backends.ray.lost import ACTOR_LOST, cause
from pipeline.errors import BackendLost

if TYPE_CHECKING:
    from backends.ray.engines import Replica
    from backends.ray.trainer import RayTrainer


class Collective:
    def __init__(self, trainer: RayTrainer, backend: str) -> None:
        """`backend`: torch.distributed's, "nccl" (every actor on a GPU of its own) or "gloo"."""
        self.trainer = trainer
        self.backend = backend
        self.members: tuple[int, ...] | None = None  # the replicas' incarnations in the group
        self.builds = 0

    @property
    def actor(self) -> Any:
        return self.trainer.ranks[0][0]

    async def refit(self, version: int, replicas: Sequence[Replica]) -> list[dict[str, int] | None]:
        """Broadcast the trainer's weights as `version` to every replica; their fingerprints."""
        if self.members != tuple(r.incarnation for r in replicas):
            address = await self.actor.open_group.remote()
            world = 1 + len(replicas)
            await self._all(
                "the rebuild of the weights' process group",
                self.actor.join_group.remote(address, 0, world, self.backend),
                [(r, r.actor.join_group.remote(address, 1 + r.index, world, self.backend)) for r in replicas],
            )
            self.members = tuple(r.incarnation for r in replicas)
            self.builds += 1
        return await self._all(
            f"the weight broadcast of version {version}",
            self.actor.send_weights.remote(version),
            [(r, r.actor.receive_weights.remote(version)) for r in replicas],
        )

    def package(self, version: int) -> Any:
        """Reference of an object-store package of the last broadcast's weights (`version`)."""
        return self.actor.kept_weights.remote(version)

    async def _all(self, what: str, trainer: Any, replicas: list[tuple[Replica, Any]]) -> list[Any]:
        """Await the trainer's call and every replica's (a collective needs all of them at once);
        the replicas' answers. A member's death stops the run."""
        answers: list[Any] = [None] * len(replicas)

        async def one(index: int | None, name: str, call: Any) -> None:
            try:
                answer = await call
            except ACTOR_LOST as error:
                raise BackendLost(
                    f"placement: {name} died during {what} (placement.weights: collective): "
                    f"{cause(error)}; the run stops here: its last committed checkpoint is intact, "
                    "run again to resume from it"
                ) from None
            if index is not None:
                answers[index] = answer

        async with anyio.create_task_group() as group:
            group.start_soon(one, None, "the trainer", trainer)
            for replica, call in replicas:
                group.start_soon(one, replica.index, f"engine replica {replica.index}", call)
        return answers
