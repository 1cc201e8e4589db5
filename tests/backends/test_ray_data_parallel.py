"""Data parallelism on the session's CPU Ray cluster (`train.data_parallel: 2`, gloo): the
placement starts one trainer actor a rank, joined into one world, and their step is one rank's.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import anyio
import pytest
import ray
import torch

import pipeline
from backends.placement import Placed
from backends.ray.place import place_on_ray
from backends.ray.weights import unpack
from backends.registry import build_trainer_alone
from pipeline.contracts.errors import BackendLost
from pipeline.metrics import read
from pipeline.runner import StopRequest
from pipeline.shell.backend_input import backend_input
from stages.checkpoint import committed
from tests.backends.test_ray_placement import SMALL, run
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
            if key != "train/computed_tokens":  # the work, which each rank's packing decides
                assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for name, value in like:
        torch.testing.assert_close(ranks[0][name], value, atol=1e-5, rtol=1e-5, msg=name)
        assert torch.equal(ranks[0][name], ranks[1][name]), name


# -- whole runs (the quickstart through `run_program`, backends captured by `placements`) ------


@pytest.mark.parametrize(
    "where",
    [
        pytest.param(["colocated=true"], id="colocated"),
        pytest.param(["placement.engines=2"], id="apart-two-engines"),
    ],
)
def test_quickstart_learns_at_data_parallel_2(
    tmp_path: Path, placements: list[Placed], where: list[str]
) -> None:
    """Colocated: an engine replica on each rank's actor, each stood down and woken by the
    gate (handoff checks on: every replica's fingerprints are the trainer's); apart: two engine
    replicas refitted from rank 0. Both serve requests."""
    summary = run(
        tmp_path,
        "run.steps=80",
        "train.data_parallel=2",
        *where,
        "eval.every_steps=40",
        "eval.num_prompts=64",
        "gates.checks=[{metric: eval/reward, stat: at, step: 80, ge: 0.9}]",
    )
    assert summary.passed, summary.verdict
    [placed] = placements
    assert len(placed.trainer.ranks) == 2 and len(placed.engine.replicas) == 2
    if where == ["colocated=true"]:
        assert [r.actor for r in placed.engine.replicas] == [actor for actor, _ in placed.trainer.ranks]
    assert {r for _, _, r in placed.engine.events} == {0, 1}
    assert all(placed.agreed)


def figures(run_dir: Path) -> list[tuple[str, ...]]:
    keys = ("reward/mean", "train/loss", "train/grad_norm", "train/token_mult_prob_error")
    return [tuple(float(r[k]).hex() for k in keys) for r in read(run_dir / "metrics.jsonl")]


def test_a_stop_and_resume_at_data_parallel_2_continues_exactly(
    tmp_path: Path, placements: list[Placed]
) -> None:
    """At L = 0 every rank's shard of the optimizer state and every replica's sampler state
    come back from the one checkpoint: the resumed run logs the uninterrupted run's figures."""
    same = [
        "run.steps=4",
        "colocated=true",
        "train.data_parallel=2",
        "async_rl.max_lookahead_versions=0",
        *SMALL,
    ]
    run(tmp_path / "straight", *same)
    stop = StopRequest()

    def echo(record: dict[str, Any]) -> None:
        if record["step"] == 2:
            stop.request("test stop")

    run(tmp_path / "stopped", *same, echo=echo, stop=stop)
    checkpoint = committed(tmp_path / "stopped" / "run" / "checkpoints")[-1]
    assert {"trainer.pt", "trainer.rank1.pt"} <= {p.name for p in checkpoint.iterdir()}
    resumed = run(tmp_path / "stopped", *same)
    assert resumed.steps_done == 4
    assert figures(tmp_path / "stopped" / "run") == figures(tmp_path / "straight" / "run")
    with pytest.raises(pipeline.RecipeError) as raised:  # its shards are two ranks'
        run(tmp_path / "stopped", *same[1:], "run.steps=5", "train.data_parallel=1")
    assert str(raised.value).startswith("train.data_parallel: differs from checkpoint ")


def test_a_killed_trainer_rank_stops_the_run_naming_it(tmp_path: Path, placements: list[Placed]) -> None:
    def echo(record: dict[str, Any]) -> None:
        if record["step"] == 2:
            os.kill(placements[0].trainer.ranks[1][1]["pid"], signal.SIGKILL)

    with pytest.raises(BackendLost) as raised:
        run(tmp_path, "run.steps=6", "train.data_parallel=2", "checkpoint.every_steps=1", *SMALL, echo=echo)
    where = placements[0].trainer.ranks[1][1]
    assert str(raised.value).startswith(
        f"placement: trainer rank 1 (pid {where['pid']}, node {where['node_id'][:12]}) died "
    )
    assert committed(tmp_path / "run" / "checkpoints")
