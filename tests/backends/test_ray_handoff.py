"""The handoff checks across Ray engine replicas, on the session's Ray cluster: the quickstart's
backend placed with two engine replicas and a trainer (real `BackendPart` actors, the real
`RayEngine`, `RayTrainer` and `EngineGate`), one replica made faulty by a subclass.

- Fingerprints: after a refit the gate compares the trainer's fingerprint with the one the
  replicas agree on; a tensor on which one replica differs (its copy corrupted) fails the step
  naming that tensor, whichever replica it is.
- Versions: a replica's answer that says it served weights outside what was announced between
  the request's dispatch and its answer fails the run (`WrongVersion`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
import ray

import pipeline
from backends.placement import Placed
from backends.ray import place as ray_place
from backends.ray.actors import BackendPart
from backends.ray.engines import WrongVersion
from pipeline.clock import DeadlineClock, MonotonicTime
from pipeline.contracts.errors import HandoffMismatch
from pipeline.contracts.messages import TrainGroup, TrainSample
from pipeline.gate import EngineGate
from pipeline.shell.backend_input import backend_input

# The actor class below travels to the workers by value (they need not import the tests).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CORRUPTED = "model.layers.0.mlp.down_proj.weight"
VOCAB = 16  # the quickstart model's


class FaultyPart(BackendPart):
    """A `BackendPart` that can be told to corrupt its copy of the next weights it is sent, or
    to say that it served a version one past the one it holds."""

    fault: str | None = None

    def set_fault(self, fault: str | None) -> None:
        self.fault = fault

    async def set_weights(self, version: int, package: Any) -> dict[str, int] | None:
        if self.fault == "weights":
            from backends.ray.weights import Package

            tensors = dict(package.tensors)
            tensors[CORRUPTED] = tensors[CORRUPTED].clone()
            tensors[CORRUPTED][0] += 1.0  # a row every fingerprint reads
            package = Package(package.version, package.transport, tensors)
        return await super().set_weights(version, package)

    async def generate(self, requests: list[Any]) -> tuple[int, int, bytes, dict[int, Exception]]:
        first, last, encoded, errors = await super().generate(requests)
        if self.fault == "version":
            last += 1
        return first, last, encoded, errors


@pytest.fixture(scope="module")
def placed(ray_cluster: Any) -> Iterator[Placed]:
    recipe = pipeline.load_recipe(
        "recipes/quickstart.yaml",
        [
            "run.progress=false",
            "colocated=false",
            "model.threads=1",
            "placement.backend=ray",
            "placement.engines=2",
            "placement.engine_cpus=0.25",
            "placement.trainer_cpus=0.25",
            "async_rl.handoff_checks=true",
        ],
    )
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(ray_place, "_Part", ray.remote(FaultyPart))
    try:
        backend = ray_place.place_on_ray(backend_input(recipe), vocab_size=VOCAB, stop_ids=[1])
    finally:
        monkeypatch.undo()
    yield backend
    backend.close()


@pytest.fixture
def faults(placed: Placed) -> Iterator[Any]:
    """`faults(i, fault)` sets replica i's fault; every fault is cleared after the test."""

    def set_fault(index: int, fault: str | None) -> None:
        ray.get(placed.engine.replicas[index].actor.set_fault.remote(fault))

    yield set_fault
    for replica in placed.engine.replicas:
        ray.get(replica.actor.set_fault.remote(None))


def _groups(vocab: int) -> list[TrainGroup]:
    return [
        TrainGroup(
            group_id=f"0-{g}",
            prompt_tokens=(2 + g, 3, 4),
            samples=tuple(
                TrainSample(
                    tokens=tuple((5 + g + i + j) % vocab for j in range(3)),
                    logprobs=(-2.0, -2.1, -2.2),
                    reward=float(i % 2),
                    advantage=(1.0, -1.0)[i % 2],
                )
                for i in range(4)
            ),
        )
        for g in range(2)
    ]


async def _step(placed: Placed) -> None:
    """One train step through a gate that checks the handoff (the gate of the pipeline's)."""
    engine = placed.engine
    gate = EngineGate(engine, DeadlineClock(MonotonicTime()), version=engine.version, checks=placed.trainer)
    await gate.step(lambda: placed.trainer.train_step(_groups(VOCAB)))


@pytest.mark.parametrize("replica", [0, 1])
async def test_a_replica_serving_other_weights_than_the_trainers_fails_the_refits_check(
    placed: Placed, faults: Any, replica: int
) -> None:
    """Catches a refit that keeps no fingerprint of the replicas, or takes one replica's for all."""
    await _step(placed)  # both replicas agree with the trainer: no error
    assert placed.engine.fingerprint() == placed.trainer.fingerprint() is not None
    faults(replica, "weights")
    with pytest.raises(HandoffMismatch) as raised:
        await _step(placed)
    version = placed.engine.version
    assert str(raised.value) == (
        f"after the refit to version {version} the engine serves weights other than the trainer's: "
        f"{CORRUPTED} differs; its copy is stale or corrupted"
    )


async def test_a_replica_answering_with_a_version_it_was_not_sent_fails_the_run(
    placed: Placed, faults: Any
) -> None:
    """Catches an engine that does not compare a replica's served versions with the announced."""
    assert len(await placed.engine.generate([3, 4, 5], 2)) == 2
    faults(0, "version")
    faults(1, "version")
    with pytest.raises(WrongVersion, match=r"^engine replica \d served weights of versions"):
        await placed.engine.generate([3, 4, 5], 2)
