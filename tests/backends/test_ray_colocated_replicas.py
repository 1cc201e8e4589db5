"""Colocated engine replicas (one a data-parallel rank): the gate's stand-down and wake reach
every replica, their reports combine, and a replica that dies is named."""

from __future__ import annotations

from collections import Counter
from typing import Any

import anyio
import pytest
import ray.exceptions

from backends.ray.engines import RayEngine, Replica
from backends.ray.wire import encode_completions
from pipeline.contracts.errors import BackendLost


class _Method:
    """`actor.method.remote()`: records the call, answers `answer` (or raises it)."""

    def __init__(self, calls: list[str], name: str, answer: Any) -> None:
        self.calls, self.name, self.answer = calls, name, answer

    def remote(self) -> Any:
        self.calls.append(self.name)

        async def answer() -> Any:
            if isinstance(self.answer, BaseException):
                raise self.answer
            return self.answer

        return answer()


class _Actor:
    def __init__(self, index: int, calls: list[str], *, memory: int, served: Any) -> None:
        self.stand_down = _Method(calls, f"stand_down {index}", memory)
        self.wake = _Method(calls, f"wake {index}", served)


def _engine(*actors: _Actor) -> RayEngine:
    return RayEngine(
        [Replica(i, actor, {"pid": i}) for i, actor in enumerate(actors)],
        spawn=None,
        publish=None,
        colocated=True,
        max_restarts=0,
        counts=Counter(),
    )


def test_every_replica_stands_down_and_wakes() -> None:
    calls: list[str] = []
    engine = _engine(
        _Actor(0, calls, memory=0, served={"a": 1, "b": 2}),
        _Actor(1, calls, memory=3, served={"a": 1, "b": 5}),
    )
    anyio.run(engine.stand_down)
    assert sorted(calls) == ["stand_down 0", "stand_down 1"]
    assert engine.memory_in_use() == 3  # what the replicas still hold, together
    anyio.run(engine.wake)
    assert sorted(calls[2:]) == ["wake 0", "wake 1"]
    assert engine.fingerprint() == {"a": 1, "b": -1}  # b differs: no trainer's checksum matches


def test_a_replica_that_died_fails_the_stand_down_naming_it() -> None:
    calls: list[str] = []
    died = ray.exceptions.ActorUnavailableError("the actor's process is gone", None)
    engine = _engine(_Actor(0, calls, memory=0, served=None), _Actor(1, calls, memory=died, served=None))
    with pytest.raises(BackendLost) as raised:
        anyio.run(engine.stand_down)
    assert str(raised.value).startswith("engine replica 1's actor (colocated with the trainer) died: ")


class _Generating:
    """`actor.generate.remote(requests)` that answers (no completions) once `release` is set:
    until then its requests stay in flight."""

    def __init__(self, release: anyio.Event) -> None:
        outer = self

        class _Method:
            def remote(self, requests: Any) -> Any:
                async def answer() -> Any:
                    await outer.release.wait()
                    return 0, 0, encode_completions([[] for _ in requests]), {}

                return answer()

        self.release = release
        self.generate = _Method()


def test_requests_go_to_the_replica_with_the_fewest_rows_in_flight() -> None:
    """A group of 8 samples weighs 8 rows, not one request: the next two single-row requests
    both go to the other replica."""
    counts: list[list[int]] = []

    async def main() -> None:
        release = anyio.Event()
        engine = RayEngine(
            [Replica(i, _Generating(release), {"pid": i}) for i in range(2)],
            spawn=None,
            publish=None,
            colocated=False,
            max_restarts=0,
            counts=Counter(),
        )
        async with anyio.create_task_group() as group:
            for n in (8, 1, 1):
                group.start_soon(engine.generate, (1, 2), n)
                await anyio.sleep(0)
            counts.append([r.in_flight for r in engine.replicas])
            release.set()
        counts.append([r.in_flight for r in engine.replicas])
        counts.append([replica for _, _, replica in engine.events])

    anyio.run(main)
    assert counts == [[8, 2], [0, 0], [0, 1, 1]]


async def test_a_colocated_part_reports_after_its_stand_down_and_wake_what_its_engine_holds() -> None:
    """The real actor class (in this process): its stand-down answers the engine's memory and its
    wake the engine's fingerprint, the trainer's after a step (what the gate's checks compare)."""
    import pipeline
    from backends.ray.actors import BackendPart
    from backends.ray.wire import encode_groups
    from pipeline.shell.backend_input import backend_input
    from tests.backends.test_ray_handoff import VOCAB, _groups

    recipe = pipeline.load_recipe("recipes/quickstart.yaml", ["run.progress=false", "model.threads=1"])
    part = BackendPart(backend_input(recipe), role="both", vocab_size=VOCAB, stop_ids=[1])
    try:
        _, published, _ = await part.train_step(encode_groups(_groups(VOCAB)))
        assert await part.stand_down() in (0, None)
        assert await part.wake() == published == part.trainer.fingerprint() is not None
    finally:
        part.trainer.close()
        part.engine.close()
