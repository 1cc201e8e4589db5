"""The megatron trainer on the session's CPU Ray cluster: a trainer actor a tensor-parallel rank
(`train.tensor_parallel`, gloo), separate from the engine or colocated with it on rank 0, and
a resume of their checkpoint. Each test runs the real pipeline (`run_program`) on the
quickstart; the engine's handoff checks are on, so a step whose engine did not serve exactly
the trainer's weights (gathered from every rank) stops the run."""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("megatron.core")

import pipeline
from backends.place import place
from backends.placement import Placed
from backends.ray.place import START_S
from pipeline.contracts.errors import BackendLost
from pipeline.metrics import read
from pipeline.shell import run as shell_run
from stages.checkpoint import committed

MEGATRON = [
    "run.progress=false",
    "run.plot=false",
    "model.threads=1",
    "train.backend=megatron",
    "placement.backend=ray",
    "placement.engine_cpus=0.25",
    "placement.trainer_cpus=0.25",
    "prompts.prompts_per_step=8",
    "rollout.samples_per_prompt=4",
    "eval.every_steps=0",
    "gates.checks=[]",
]
# The hang guard (pytest-timeout's 300 s) lies past the placement's own allowance: each placed
# run may wait START_S for its actors (each rank imports megatron, which a loaded machine takes
# minutes over), and a test places three runs at most.
pytestmark = pytest.mark.timeout(3 * START_S + 300)
KEYS = ("reward/mean", "train/loss", "train/grad_norm", "train/token_mult_prob_error")


def run(directory: Path, *overrides: str, placed: bool = True) -> Any:
    given = MEGATRON if placed else [o for o in MEGATRON if not o.startswith("placement.")]
    recipe = pipeline.load_recipe("recipes/quickstart.yaml", [f"run.dir={directory}", *given, *overrides])
    return anyio.run(lambda: shell_run.run_program(recipe))


def figures(directory: Path) -> list[list[float]]:
    return [[r[k] for k in KEYS] for r in read(directory / "metrics.jsonl")]


def close(a: list[list[float]], b: list[list[float]]) -> bool:
    return len(a) == len(b) and all(
        math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-7)
        for ra, rb in zip(a, b, strict=True)
        for x, y in zip(ra, rb, strict=True)
    )


def test_trainer_actors_at_tensor_parallel_2_train_what_one_rank_trains(
    tmp_path: Path, ray_cluster: Any
) -> None:
    """Separate, at L = 0: two gloo ranks log one rank's rewards, losses and gradient norms (to
    float32 reduction order), and each writes its shard of megatron's checkpoint."""
    same = ["run.steps=3", "colocated=false", "async_rl.max_lookahead_versions=0"]
    one, two = tmp_path / "tp1", tmp_path / "tp2"
    assert run(one, *same).steps_done == 3
    assert run(two, *same, "train.tensor_parallel=2").steps_done == 3
    assert close(figures(one), figures(two)), (figures(one), figures(two))
    shards = sorted(p.name for p in (two / "checkpoints" / "step-000003" / "megatron").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    assert (one / "checkpoints" / "step-000003" / "megatron").is_dir()  # megatron trained, not torch


def test_tensor_parallel_2_colocated_on_rank_0_trains_as_in_process_and_resumes(
    tmp_path: Path, ray_cluster: Any
) -> None:
    """Colocated: rank 0's actor holds the engine, which serves the weights every rank gathered
    after the step (the wake's handoff check compares them with the trainer's); the run logs
    the in-process single-rank run's figures, and a run stopped after 2 steps and resumed to 3
    logs the uninterrupted run's third step."""
    same = ["colocated=true", "async_rl.max_lookahead_versions=0"]
    local, whole, resumed = tmp_path / "local", tmp_path / "whole", tmp_path / "resumed"
    run(local, *same, "run.steps=3", placed=False)
    assert run(whole, *same, "run.steps=3", "train.tensor_parallel=2").steps_done == 3
    assert close(figures(local), figures(whole)), (figures(local), figures(whole))
    assert run(resumed, *same, "run.steps=2", "train.tensor_parallel=2").steps_done == 2
    again = run(resumed, *same, "run.steps=3", "train.tensor_parallel=2")
    assert (again.steps_done, again.policy_version) == (3, 3)
    assert close(figures(resumed)[-1:], figures(whole)[-1:]), (figures(resumed), figures(whole))


def test_a_rank_that_dies_stops_the_run_naming_it_with_the_last_checkpoint_intact(
    tmp_path: Path, ray_cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 killed after step 2's save: rank 0, waiting on it in a collective, is not waited
    for; the run stops with the dead rank's name and steps 1 and 2 committed."""
    found: list[Placed] = []

    def capture(*args: Any, **kwargs: Any) -> Placed:
        found.append(place(*args, **kwargs))
        return found[-1]

    def echo(record: dict[str, Any]) -> None:
        if record["step"] == 2:
            os.kill(found[0].trainer.ranks[1][1]["pid"], signal.SIGKILL)

    monkeypatch.setattr(shell_run, "place", capture)
    recipe = pipeline.load_recipe(
        "recipes/quickstart.yaml",
        [
            f"run.dir={tmp_path}",
            *MEGATRON,
            "run.steps=6",
            "checkpoint.every_steps=1",
            "colocated=false",
            "train.tensor_parallel=2",
        ],
    )
    with pytest.raises(BackendLost) as raised:
        anyio.run(lambda: shell_run.run_program(recipe, echo=echo))
    where = found[0].trainer.ranks[1][1]
    assert str(raised.value).startswith(
        f"placement: trainer rank 1 (pid {where['pid']}, node {where['node_id'][:12]}) died during step 3: "
    )
    assert [p.name for p in committed(tmp_path / "checkpoints")] == ["step-000001", "step-000002"]
