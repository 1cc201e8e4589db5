"""megatron's inference engine (`rollout.engine: megatron`) on the session's CPU Ray cluster,
through the real pipeline (`run_program`) on the quickstart with the megatron trainer: colocated
inside the trainer rank's actor (it serves that rank's module, stood down for each step), and
apart as an engine replica of its own (a `GPTModel` refitted with the trainer's published
weights). The handoff checks are on, so a step whose engine does not serve exactly the
trainer's weights stops the run.

megatron's dynamic engine needs CUDA, and the recipe refuses it on the CPU: the placement is
handed the backend's input with `rollout.engine` set to megatron past that check, and its actors
are `OnCpu` parts, which put a fake engine over the model they are handed in place of
megatron's (in the actor's process, where the test's monkeypatching does not reach).
tests/gpu/test_megatron_gpu.py runs the real engine on Ray."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import msgspec
import pytest
import ray

pytest.importorskip("megatron.core")

import pipeline
from backends.placement import Placed
from backends.ray import place as ray_place
from backends.ray.actors import BackendPart
from backends.ray.place import START_S
from pipeline.shell import run as shell_run
from pipeline.testing import FakeDynamicEngine

# The classes below travel to the workers by value (they need not import the tests).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(2 * START_S + 300)
PROMPTS = 8


class RandomEngine(FakeDynamicEngine):
    """A fake of megatron's engine whose samples differ (each request's tokens start from a
    random offset), so rewards vary within a group and every step changes the weights; with
    the KV cache and the sampling RNG `MegatronInference` reads from megatron's."""

    def __init__(self, seed: int) -> None:
        import torch

        super().__init__(length=5, vocab=16)
        self.draw = random.Random(seed)
        self.context = SimpleNamespace(memory_buffer=None)
        self.controller = SimpleNamespace(sampling_rng=torch.Generator())

    def add_request(self, request_id: int, prompt: list[int], sampling_params: Any) -> None:
        start = (prompt[-1] + self.draw.randrange(self.vocab)) % self.vocab
        super().add_request(request_id, [*prompt[:-1], start], sampling_params)


class OnCpu(BackendPart):
    """A `BackendPart` whose megatron engine is a `RandomEngine` (the rest as built)."""

    def __init__(self, spec: Any, **options: Any) -> None:
        from backends.torch.runtime import load

        load()  # before torch's first import, as BackendPart does
        from backends.megatron import serve

        def engine_on_cpu(model: Any, inference: Any, *, seed: int, **rest: Any) -> RandomEngine:
            return RandomEngine(seed)

        serve.dynamic_engine = engine_on_cpu
        super().__init__(spec, **options)

    def engine_kind(self) -> str:
        return type(self.engine).__name__


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str) -> tuple[Any, Placed, list[Any]]:
    """The run's summary, its placed backend (every replica megatron's engine) and each step's
    record (groups trained, engine and trainer fingerprints as the step began)."""
    placed: list[Placed] = []
    steps: list[Any] = []
    kinds: list[str] = []  # each replica's engine

    def megatron_engine(spec: Any, **build: Any) -> Placed:
        sampling = msgspec.structs.replace(spec.sampling, engine="megatron")
        backend = ray_place.place_on_ray(msgspec.structs.replace(spec, sampling=sampling), **build)
        placed.append(backend)
        kinds.extend(ray.get([r.actor.engine_kind.remote() for r in backend.engine.replicas]))
        step = backend.trainer.train_step

        async def recording(groups: Any) -> Any:
            steps.append(
                ({g.group_id for g in groups}, backend.engine.fingerprint(), backend.trainer.fingerprint())
            )
            return await step(groups)

        backend.trainer.train_step = recording  # type: ignore[method-assign]
        return backend

    monkeypatch.setattr(ray_place, "_Part", ray.remote(OnCpu))
    monkeypatch.setattr(shell_run, "place", megatron_engine)
    recipe = pipeline.load_recipe(
        "recipes/quickstart.yaml",
        [
            f"run.dir={tmp_path}",
            "run.progress=false",
            "run.plot=false",
            "model.threads=1",
            "train.backend=megatron",
            "placement.backend=ray",
            "placement.engine_cpus=0.25",
            "placement.trainer_cpus=0.25",
            f"prompts.prompts_per_step={PROMPTS}",
            "rollout.samples_per_prompt=4",
            "eval.every_steps=0",
            "gates.checks=[]",
            "async_rl.handoff_checks=true",
            "run.steps=3",
            *overrides,
        ],
    )
    summary = anyio.run(lambda: shell_run.run_program(recipe))
    (backend,) = placed
    assert kinds == ["MegatronInference"] * len(backend.engine.replicas)
    return summary, backend, steps


def _trained_each_group_once(summary: Any, steps: list[Any]) -> None:
    """Three steps, each on PROMPTS groups never trained before."""
    assert (summary.steps_done, summary.policy_version) == (3, 3)
    groups = [trained for trained, _, _ in steps]
    assert [len(g) for g in groups] == [PROMPTS] * 3 and len(set().union(*groups)) == 3 * PROMPTS


def _served_each_steps_weights(summary: Any, steps: list[Any]) -> None:
    """From step 2 on, the engine's fingerprint as the step began is the trainer's (the weights
    of the step before), which changed at each step."""
    _trained_each_group_once(summary, steps)
    served = [engine for _, engine, _ in steps[1:]]
    assert served == [trainer for _, _, trainer in steps[1:]] and None not in served
    assert served[0] != served[1]


def test_colocated_in_the_trainer_ranks_actor(tmp_path: Path, ray_cluster: Any, monkeypatch: Any) -> None:
    """The engine serves the rank's own module, stood down for each step; it reports no
    fingerprint (nothing moves at the hand-off), so the handoff checks leave it unchecked."""
    summary, backend, steps = _run(
        tmp_path, monkeypatch, "colocated=true", "async_rl.max_lookahead_versions=0"
    )
    assert backend.engine.blocks_training and backend.engine.wake_carries_weights
    _trained_each_group_once(summary, steps)
    assert [engine for _, engine, _ in steps] == [None] * 3


def test_apart_as_a_replica_refitted_with_the_trainers_weights(
    tmp_path: Path, ray_cluster: Any, monkeypatch: Any
) -> None:
    """A replica actor of its own, one version ahead (L = 1): each refit copies the trainer's
    package into its `GPTModel`, whose fingerprint is then the trainer's."""
    summary, backend, steps = _run(
        tmp_path, monkeypatch, "colocated=false", "async_rl.max_lookahead_versions=1"
    )
    assert not backend.engine.blocks_training
    _served_each_steps_weights(summary, steps)
