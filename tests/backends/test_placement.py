"""`placement.weights` resolved from the recipe: auto is CUDA IPC exactly where one engine and
the trainer share a GPU, and an explicit choice is kept."""

from __future__ import annotations

import pytest

import pipeline
from backends.placement import RayPlacement, weights_transport

SEPARATE = ["colocated=false", "placement.backend=ray"]
SHARED_GPU = ["model.device=cuda", "placement.engine_gpus=0.5", "placement.trainer_gpus=0.5"]


@pytest.mark.parametrize(
    ("overrides", "transport"),
    [
        pytest.param([], "object_store", id="cpu"),
        pytest.param(SHARED_GPU, "cuda_ipc", id="one-gpu-shared"),
        pytest.param([*SHARED_GPU, "placement.engines=2"], "object_store", id="two-engines"),
        pytest.param(["model.device=cuda"], "object_store", id="a-gpu-each"),
        pytest.param([*SHARED_GPU, "placement.weights=object_store"], "object_store", id="asked-store"),
        pytest.param(["placement.weights=collective"], "collective", id="asked-collective"),
    ],
)
def test_weights_transport(overrides: list[str], transport: str) -> None:
    recipe = pipeline.load_recipe("recipes/quickstart.yaml", [*SEPARATE, *overrides])
    assert isinstance(recipe.placement, RayPlacement)
    where = {"colocated": recipe.colocated, "device": recipe.model.device, "ranks": 1}
    assert weights_transport(recipe.placement, **where) == transport
