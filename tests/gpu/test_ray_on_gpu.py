"""Ray placement on one GPU: the colocated pair in one GPU actor, and the engine and the trainer
in two actors sharing the GPU, weights by CUDA IPC (the handoff checks compare every tensor's
fingerprint after each refit, so weights that did not arrive fail the run)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import pytest

import pipeline
from pipeline.metrics import read
from pipeline.shell import run as shell_run

pytestmark = pytest.mark.gpu

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture
def gpu_ray():
    """A Ray runtime with this machine's GPUs (the one an earlier CPU test started has none)."""
    import ray

    if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("this session's Ray cluster has no GPU")
    return ray


def _quickstart_on_ray(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: list[str]) -> Any:
    """Four quickstart steps on CUDA through Ray placement (`overrides` last); what `place` placed."""
    placed = []
    place = shell_run.place
    monkeypatch.setattr(shell_run, "place", lambda *a, **k: placed.append(place(*a, **k)) or placed[-1])
    recipe = pipeline.load_recipe(
        "recipes/quickstart.yaml",
        [
            f"run.dir={tmp_path / 'run'}",
            "run.steps=4",
            "run.progress=false",
            "run.plot=false",
            "model.device=cuda",
            "eval.every_steps=0",
            "gates.checks=[]",
            "placement.backend=ray",
            *overrides,
        ],
    )
    summary = anyio.run(shell_run.run_program, recipe)
    assert summary.steps_done == 4
    return placed[0]


@pytest.mark.parametrize(
    ("overrides", "transport"),
    [
        pytest.param(["colocated=true"], "object_store", id="colocated-one-actor"),
        pytest.param(
            ["colocated=false", "placement.engine_gpus=0.5", "placement.trainer_gpus=0.5"],
            "cuda_ipc",
            id="separate-sharing-the-gpu",
        ),
    ],
)
def test_the_quickstart_on_one_gpu_through_ray(
    tmp_path: Path, gpu_ray, monkeypatch: pytest.MonkeyPatch, overrides: list[str], transport: str
) -> None:
    placed = _quickstart_on_ray(
        tmp_path,
        monkeypatch,
        ["async_rl.max_lookahead_versions=0", *overrides],  # on-policy: the mismatch is the numerics alone
    )
    assert placed.trainer.transport == transport
    records = read(tmp_path / "run" / "metrics.jsonl")
    assert all(r["train/token_mult_prob_error"] < 1.01 for r in records)


def test_weights_by_an_nccl_broadcast_between_two_gpus(
    tmp_path: Path, gpu_ray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`placement.weights: collective` on GPUs: the trainer and a replica, a GPU each, in one
    NCCL group (handoff checks on: every refit's fingerprints are compared)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: the trainer's and the replica's")
    placed = _quickstart_on_ray(tmp_path, monkeypatch, ["colocated=false", "placement.weights=collective"])
    assert placed.engine.collective.backend == "nccl"
    assert placed[0].engine.fingerprint() == placed[0].trainer.fingerprint() is not None
