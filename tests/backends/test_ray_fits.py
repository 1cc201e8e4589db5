"""A placement no node of the Ray cluster can hold fails at once, naming the field (Ray would
hold the actors' requests forever; the run waited for their start deadline)."""

from __future__ import annotations

from typing import Any

import pytest

import pipeline
from backends.placement import RayPlacement
from backends.ray.fits import check_fits, demands
from pipeline.contracts.errors import RecipeError
from pipeline.shell.backend_input import backend_input

QUICKSTART = "recipes/quickstart.yaml"


def node(alive: bool = True, **resources: float) -> dict[str, Any]:
    return {"Alive": alive, "Resources": resources}


def actors(*overrides: str, recipe_path: str = QUICKSTART) -> list[tuple[str, dict[str, float]]]:
    recipe = pipeline.load_recipe(recipe_path, ["placement.backend=ray", *overrides])
    assert isinstance(recipe.placement, RayPlacement)
    ranks = recipe.train.tensor_parallel
    gpus = {"engine": 0.0, "trainer": 0.0}
    return demands(recipe.placement, colocated=recipe.colocated, ranks=ranks, gpus=gpus)


@pytest.mark.parametrize(
    ("overrides", "nodes", "message"),
    [
        (
            ["placement.trainer_cpus=64"],
            [node(CPU=2), node(CPU=8)],
            "placement.trainer_cpus: a trainer actor asks Ray for 64 CPU, but no node of the cluster has "
            "that many (the most a node has: 8); ask for less, or add a node that has it",
        ),
        (
            ["placement.trainer_resources={accel: 1}"],
            [node(CPU=2)],
            "placement.trainer_resources: a trainer actor asks Ray for 1 accel, but no node of the cluster "
            "has that many (the most a node has: 0); ask for less, or add a node that has it",
        ),
        (
            ["placement.trainer_resources={accel: 1}"],
            [node(CPU=2, accel=1, alive=False), node(CPU=2)],  # the node that has it is gone
            "placement.trainer_resources: a trainer actor asks Ray for 1 accel, but no node of the cluster "
            "has that many (the most a node has: 0); ask for less, or add a node that has it",
        ),
        (
            ["placement.trainer_resources={accel: 1}", "placement.trainer_cpus=2"],
            [node(CPU=1, accel=1), node(CPU=2)],
            "placement.trainer_cpus, placement.trainer_resources: a trainer actor asks Ray for 2 CPU, "
            "1 accel on one node, but no node of the cluster has all of it; ask for less, or add a node "
            "that has it",
        ),
        (
            ["colocated=false", "placement.engines=3"],
            [node(CPU=2)],
            "placement.engine_cpus, placement.trainer_cpus: the run's actors ask Ray for 4 CPU in all, but "
            "the cluster has 2; ask for less, or add nodes",
        ),
        (
            ["placement.reward_workers=2", "placement.reward_cpus=2"],
            [node(CPU=4)],
            "placement.reward_cpus, placement.trainer_cpus: the run's actors ask Ray for 5 CPU in all, but "
            "the cluster has 4; ask for less, or add nodes",
        ),
    ],
    ids=["cpus", "custom-resource", "dead-node", "not-on-one-node", "in-all", "reward-workers"],
)
def test_a_placement_the_cluster_cannot_hold(overrides: list[str], nodes: list[Any], message: str) -> None:
    with pytest.raises(RecipeError) as raised:
        check_fits(actors(*overrides), nodes)
    assert str(raised.value) == message


def test_environment_workers_ask_for_their_cpus() -> None:
    wanted = actors(
        "placement.environment_workers=2",
        "placement.environment_cpus=2",
        recipe_path="recipes/multi-turn-cpu.yaml",
    )
    with pytest.raises(RecipeError) as raised:
        check_fits(wanted, [node(CPU=4)])
    assert str(raised.value) == (
        "placement.environment_cpus, placement.trainer_cpus: the run's actors ask Ray for 5 CPU in all, "
        "but the cluster has 4; ask for less, or add nodes"
    )


def test_a_placement_that_fits_passes() -> None:
    check_fits(actors("colocated=false", "placement.engines=2"), [node(CPU=2), node(CPU=1)])


def test_placing_on_ray_refuses_it_before_starting_an_actor(ray_cluster: Any) -> None:
    """The real wiring: `place_on_ray` asks the session's cluster (nodes node_a and node_b)."""
    from backends.ray.place import place_on_ray

    recipe = pipeline.load_recipe(
        QUICKSTART, ["placement.backend=ray", "placement.trainer_resources={node_c: 1}"]
    )
    with pytest.raises(RecipeError) as raised:
        place_on_ray(backend_input(recipe), vocab_size=16, stop_ids=[1])
    assert str(raised.value).startswith(
        "placement.trainer_resources: a trainer actor asks Ray for 1 node_c, but no node of the cluster has"
    )
