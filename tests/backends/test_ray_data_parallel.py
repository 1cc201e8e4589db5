"""Data parallelism on the session's CPU Ray cluster (`train.data_parallel: 2`, gloo): the
placement starts one trainer actor a rank, joined into one world, and their step is one rank's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import ray
import torch

import pipeline
from backends.ray.place import place_on_ray
from backends.ray.weights import unpack
from backends.registry import build_trainer_alone
from pipeline.shell.backend_input import backend_input
from tests.backends.test_torch_data_parallel import groups

RAY = [
    "run.progress=false",
    "model.threads=1",
    "placement.backend=ray",
    "placement.engine_cpus=0.25",
    "placement.trainer_cpus=0.25",
    "train.updates_per_step=2",
    "train.micro_batch_samples=4",
]


def recipe(*overrides: str) -> Any:
    return pipeline.load_recipe("recipes/quickstart.yaml", [*RAY, *overrides])


def weights_of(actor: Any, version: int, like: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    package = ray.get(actor.publish.remote(version, "object_store"))
    return dict(unpack(package, version=version, like=like))


def test_two_trainer_actors_give_the_step_of_one(ray_cluster: Any) -> None:
    """The real wiring: the placement's ranks join one world and each builds its data-parallel
    rank of the torch trainer (a rank that trained every group, or one not summed with the
    other, would not match the trainer of one rank)."""
    two = backend_input(recipe("colocated=false", "train.data_parallel=2"))
    one = build_trainer_alone(backend_input(recipe("colocated=false")), vocab_size=16)
    batches = [groups(1, vocab=16), groups(2, vocab=16)]
    expected = [anyio.run(one.train_step, batch) for batch in batches]
    placed = place_on_ray(two, vocab_size=16, stop_ids=[1])
    try:
        assert len(placed.trainer.ranks) == 2
        got = [anyio.run(placed.trainer.train_step, batch) for batch in batches]
        like = one.served_parameters()
        ranks = [weights_of(actor, 2, like) for actor, _ in placed.trainer.ranks]
    finally:
        placed.close()
        one.close()
    for metrics, want in zip(got, expected, strict=True):
        assert metrics.keys() == want.keys()
        for key, value in want.items():
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for name, value in like:
        torch.testing.assert_close(ranks[0][name], value, atol=1e-5, rtol=1e-5, msg=name)
        assert torch.equal(ranks[0][name], ranks[1][name]), name


def test_data_parallel_in_one_process_is_refused_naming_ray(tmp_path: Path) -> None:
    with pytest.raises(pipeline.RecipeError) as raised:
        pipeline.load_recipe("recipes/quickstart.yaml", ["train.data_parallel=2"])
    assert str(raised.value) == (
        "recipes/quickstart.yaml: train.data_parallel: 2 needs placement.backend: ray (a pipeline "
        "process is one rank: Ray starts one trainer actor a rank)"
    )
