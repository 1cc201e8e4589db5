"""The pipeline's `Trainer` over the trainer's Ray actors, one per rank.

Every rank runs each step, saves and loads (megatron's checkpoints are collectives over its
ranks; under data parallelism each rank writes its own shard of the optimizer state); rank 0's
metrics, fingerprint and weights are the step's (the metrics are the whole step's, summed over
the data-parallel ranks, and every rank holds the same weights). A rank whose actor dies stops
the run with `BackendLost`, naming the rank, its process and node and the step: its optimizer
state exists nowhere else, so there is nothing to save, and the last committed checkpoint
stays the one a rerun resumes from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import ray

from backends.ray.lost import ACTOR_LOST, cause, unwrapped
from backends.ray.weights import Transport
from backends.ray.wire import encode_groups
from pipeline.contracts.errors import BackendLost
from pipeline.contracts.messages import TrainGroup


class RayTrainer:
    def __init__(self, ranks: Sequence[tuple[Any, dict[str, Any]]], *, transport: Transport) -> None:
        """`ranks`: each rank's (actor, where it runs)."""
        self.ranks = list(ranks)
        self.transport = transport
        self.completed_steps = 0
        self._published: Mapping[str, int] | None = None

    async def train_step(self, groups: Sequence[TrainGroup]) -> Mapping[str, float]:
        answers: list[Any] = [None] * len(self.ranks)
        encoded = encode_groups(groups)  # once for every rank
        lost: list[tuple[int, BaseException]] = []
        failed: list[Exception] = []

        async def one(rank: int, actor: Any) -> None:
            try:
                answers[rank] = await actor.train_step.remote(encoded)
            except ACTOR_LOST as error:
                lost.append((rank, error))
            except Exception as error:
                failed.append(error)

        # Every rank's answer: a rank that died makes the others' collectives fail, often
        # before its own death is reported; the run stops naming the rank that died.
        async with anyio.create_task_group() as group:
            for rank, (actor, _) in enumerate(self.ranks):
                group.start_soon(one, rank, actor)
        if lost:
            rank, error = min(lost, key=lambda item: item[0])
            raise self.lost(rank, f"during step {self.completed_steps + 1}", error) from None
        if failed:
            raise failed[0]
        metrics, self._published, self.completed_steps = answers[0]
        return metrics

    def lost(self, rank: int, when: str, error: BaseException) -> BackendLost:
        """The error that stops the run: rank `rank`'s actor died `when` ("during step 3")."""
        where = self.ranks[rank][1]
        return BackendLost(
            f"placement: trainer rank {rank} (pid {where['pid']}, node {where['node_id'][:12]}) died "
            f"{when}: {cause(error)}; the run stops here: its last committed checkpoint is intact, "
            "run again to resume from it"
        )

    def publish(self) -> tuple[int, Any]:
        """Rank 0's weights as of now, packed where they are: (version, object reference). Not
        awaited here: the engines fetch the package from the object store themselves."""
        actor = self.ranks[0][0]
        return self.completed_steps, actor.publish.remote(self.completed_steps, self.transport)

    def fingerprint(self) -> Mapping[str, int] | None:
        return self._published

    def save(self, directory: Path) -> None:
        """Every rank's files, written by its actor into `directory` (on storage every rank's
        node sees)."""
        self._every_rank([actor.save.remote("trainer", str(directory)) for actor, _ in self.ranks])

    def snapshot(self, directory: Path) -> _RanksSnapshot:
        """Every rank takes its snapshot now (its actor keeps it); the returned snapshot's
        `write()` has every rank write its own into `directory` and returns once all have:
        only then may the controller commit (`pipeline.protocols.Snapshotting`)."""
        refs = [actor.snapshot.remote("trainer", str(directory)) for actor, _ in self.ranks]
        left = self._every_rank(refs)
        return _RanksSnapshot(self, [rank for rank, writes in enumerate(left) if writes])

    def _every_rank(self, refs: list[Any], ranks: list[int] | None = None) -> list[Any]:
        """The answer of each call in `refs`, made to `ranks` (default: each rank in order)."""
        ranks = ranks if ranks is not None else list(range(len(refs)))
        answers: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:  # the first rank to fail, not rank 0 waiting on it in a collective
            [ref], pending = ray.wait(pending, num_returns=1)
            try:
                answers[refs.index(ref)] = unwrapped(ref)
            except ACTOR_LOST as error:
                raise self.lost(ranks[refs.index(ref)], "while it saved a checkpoint", error) from None
        return answers

    def load(self, directory: Path) -> None:
        done = unwrapped([actor.load.remote("trainer", str(directory)) for actor, _ in self.ranks])
        self.completed_steps = done[0]
        self._published = ray.get(self.ranks[0][0].fingerprint.remote())

    def close(self) -> None:
        """Nothing here: the placement kills the actors (`Placed.close`)."""


class _RanksSnapshot:
    """The snapshots the ranks `writing` keep (the others wrote theirs as they took them)."""

    def __init__(self, trainer: RayTrainer, writing: list[int]) -> None:
        self.trainer = trainer
        self.writing = writing

    def write(self) -> None:
        ranks = self.trainer.ranks
        refs = [ranks[rank][0].write_snapshot.remote("trainer") for rank in self.writing]
        self.trainer._every_rank(refs, self.writing)
