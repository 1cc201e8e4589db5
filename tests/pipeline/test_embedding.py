"""Embedding: the pipeline as one task of a host application's event loop."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

import pipeline
from pipeline.contracts.messages import TrainGroup
from pipeline.recipe import convert
from pipeline.testing import FakeEngine, FakeTime, FakeTrainer


def make_recipe(tmp_path: Path, steps: int, eval_every: int = 0) -> Any:
    from pipeline.shell.recipe import Recipe

    data = {
        "run": {"dir": str(tmp_path / "run"), "steps": steps, "stop_grace_s": 1.0e6},
        "async_rl": {"max_lookahead_versions": 1},
        "prompts": {"prompts_per_step": 2, "source": {"kind": "synthetic", "num_heldout": 4}},
        "rollout": {"samples_per_prompt": 2},
        "reward": {"reward_s": 1.0e9},
        "eval": {"every_steps": eval_every, "num_prompts": 4},
    }
    return convert(data, Recipe, source="test")


async def test_runs_inside_a_running_loop_next_to_a_host_task(tmp_path: Path) -> None:
    fake = FakeTime()
    host_ticks = 0

    async def host() -> None:  # stands for a web server: it must keep getting turns
        nonlocal host_ticks
        while True:
            await fake.sleep(1)
            host_ticks += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(fake.autojump)
        tg.start_soon(host)
        summary = await pipeline.run(
            make_recipe(tmp_path, steps=3),
            engine=FakeEngine(time=fake, latency=1.0),
            trainer=FakeTrainer(time=fake, latency=10.0),
            time_source=fake,
        )
        tg.cancel_scope.cancel()
    assert (summary.steps_done, summary.policy_version, summary.stopped) == (3, 3, False)
    assert host_ticks >= 30  # the host ran all along the ~33 s of (fake) pipeline time


async def test_hooks_see_every_step_and_every_evaluation(tmp_path: Path) -> None:
    fake = FakeTime()
    steps: list[int] = []
    evals: list[int] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(fake.autojump)
        await pipeline.run(
            make_recipe(tmp_path, steps=4, eval_every=2),
            engine=FakeEngine(time=fake, latency=1.0),
            trainer=FakeTrainer(time=fake, latency=1.0),
            time_source=fake,
            echo=lambda record: steps.append(record["step"]),
            on_eval=lambda record: evals.append(record["step"]),
        )
        tg.cancel_scope.cancel()
    assert steps == [1, 2, 3, 4]
    assert evals == [0, 2, 4]


async def test_cancelling_the_awaiting_task_leaves_no_task_running(tmp_path: Path) -> None:
    fake = FakeTime()
    two_steps = anyio.Event()

    def on_step(step: int, groups: Sequence[TrainGroup]) -> None:
        if step == 2:
            two_steps.set()

    before = asyncio.all_tasks()
    async with anyio.create_task_group() as tg:
        tg.start_soon(fake.autojump)
        async with anyio.create_task_group() as run_group:
            run_group.start_soon(
                lambda: pipeline.run(
                    make_recipe(tmp_path, steps=1000),
                    engine=FakeEngine(time=fake, latency=1.0),
                    trainer=FakeTrainer(time=fake, latency=10.0, on_step=on_step),
                    time_source=fake,
                )
            )
            await two_steps.wait()
            assert len(asyncio.all_tasks()) > len(before) + 3  # the stages are running
            run_group.cancel_scope.cancel()
        tg.cancel_scope.cancel()
    assert asyncio.all_tasks() == before
    assert (tmp_path / "run" / "trace.json").is_file()


@pytest.mark.parametrize("blocks_training", [True, False], ids=["colocated", "separate"])
async def test_cancelling_mid_step_finishes_the_step_saves_it_and_says_so(
    tmp_path: Path, blocks_training: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The host cancels while the trainer is inside its third step: the step is published and
    recorded, then the run saves it (the default checkpoint.every_steps: 0 saves nothing else)."""
    from stages.checkpoint import committed

    fake = FakeTime()
    async with anyio.create_task_group() as tg:
        tg.start_soon(fake.autojump)
        async with anyio.create_task_group() as run_group:

            def on_step(step: int, groups: Sequence[TrainGroup]) -> None:
                if step == 2:
                    run_group.cancel_scope.cancel()

            run_group.start_soon(
                lambda: pipeline.run(
                    make_recipe(tmp_path, steps=1000),
                    engine=FakeEngine(time=fake, latency=1.0, blocks_training=blocks_training),
                    trainer=FakeTrainer(time=fake, latency=10.0, on_step=on_step),
                    time_source=fake,
                )
            )
        tg.cancel_scope.cancel()
    assert [p.name for p in committed(tmp_path / "run" / "checkpoints")] == ["step-000003"]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3
    assert [r.getMessage() for r in caplog.records if r.name == "stages.program"] == [
        f"cancelled: stopped after 3 steps (policy version 3); checkpoint step 3 in "
        f"{tmp_path / 'run' / 'checkpoints'}"
    ]


async def test_stop_request_stops_admission_and_drains(tmp_path: Path) -> None:
    fake = FakeTime()
    stop = pipeline.StopRequest()
    trained_batches: list[int] = []

    def on_step(step: int, groups: Sequence[TrainGroup]) -> None:
        trained_batches.append(int(groups[0].group_id.split("-")[0]))  # "batch-index"
        if step == 1:
            stop.request("host asked to stop")

    trainer = FakeTrainer(time=fake, latency=10.0, on_step=on_step)
    engine = FakeEngine(time=fake, latency=1.0, blocks_training=False)
    async with anyio.create_task_group() as tg:
        tg.start_soon(fake.autojump)
        summary = await pipeline.run(
            make_recipe(tmp_path, steps=1000), engine=engine, trainer=trainer, time_source=fake, stop=stop
        )
        tg.cancel_scope.cancel()
    assert summary.stopped
    # Batches 0-2 were admitted when the stop came (L = 1: the step-0 ticket came back and
    # admitted batch 2); they drain and train; nothing new is admitted.
    assert trained_batches == [0, 1, 2]
    assert (summary.steps_done, summary.policy_version) == (3, 3)
    assert engine.calls == 3 * 2
    assert fake.now() < 1.0e6  # drained long before the grace period ran out


def test_import_pipeline_loads_no_heavy_framework() -> None:
    code = (
        "import sys, pipeline, pipeline.testing, pipeline.shell.cli, backends.registry, stages.program\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'ray', 'megatron'})\n"
        "print(heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
