"""The run directory's contract (lock, history kept, resumes that do what they say) and
checkpoints that survive damage, on fakes: each run takes well under a second."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from test_flow import drive, make_recipe, metrics

from pipeline.contracts.errors import PipelineError, RecipeError, StageFailed
from pipeline.shell.recipe import Recipe
from pipeline.shell.run import run_program
from pipeline.testing import FakeEngine, FakeTime, FakeTrainer, FaultInjector
from pipeline.trace import Trace
from stages.checkpoint import CheckpointError, committed
from stages.checkpoint_marker import MARKER
from stages.run_dir import RunDirLock


@pytest.fixture
def fake() -> FakeTime:
    return FakeTime()


async def run(recipe: Recipe, fake: FakeTime, trainer: FakeTrainer | None = None, **options: Any) -> Any:
    return await drive(
        recipe, FakeEngine(time=fake, latency=1.0), trainer or FakeTrainer(time=fake), fake, **options
    )


def files(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir())


# -- one run at a time -----------------------------------------------------------------------


async def test_a_second_run_on_a_locked_run_dir_is_refused_naming_the_holder(
    tmp_path: Path, fake: FakeTime
) -> None:
    recipe = make_recipe(tmp_path, steps=2)
    holder = RunDirLock(Path(recipe.run.dir))
    holder.acquire()
    try:
        with pytest.raises(RecipeError) as raised:
            await run(recipe, fake)
        who = holder.path.read_text().strip()
    finally:
        holder.release()
    assert who.startswith(f"pid {os.getpid()} on ")
    assert str(raised.value) == (
        f"run.dir: {recipe.run.dir} is in use by {who}; wait for that run to end or choose another run.dir"
    )
    assert files(Path(recipe.run.dir)) == [".lock"]  # the refused run wrote nothing


async def test_a_lock_left_by_a_killed_run_does_not_block(tmp_path: Path, fake: FakeTime) -> None:
    recipe = make_recipe(tmp_path, steps=2)
    script = "import os, sys; from stages.run_dir import RunDirLock; from pathlib import Path\n"
    script += "RunDirLock(Path(sys.argv[1])).acquire(); os.kill(os.getpid(), 9)"
    done = subprocess.run([sys.executable, "-c", script, recipe.run.dir], check=False)
    assert done.returncode == -9 and (Path(recipe.run.dir) / ".lock").read_text().startswith("pid ")
    summary = await run(recipe, fake)
    assert summary.steps_done == 2


# -- no run's history lost to another ---------------------------------------------------------


async def test_a_fresh_start_over_a_run_without_a_checkpoint_keeps_its_files_apart(
    tmp_path: Path, fake: FakeTime, caplog: pytest.LogCaptureFixture
) -> None:
    recipe = make_recipe(tmp_path, steps=2)
    run_dir = Path(recipe.run.dir)
    run_dir.mkdir()  # what a run killed at step 3, before its first checkpoint, leaves
    earlier = "".join(json.dumps({"step": step}) + "\n" for step in (1, 2, 3))
    for name, text in (("metrics.jsonl", earlier), ("trace.json", "{}"), ("recipe.yaml", "run: {}\n")):
        (run_dir / name).write_text(text)
    await run(recipe, fake)
    assert [m["step"] for m in metrics(recipe)] == [1, 2]
    assert (run_dir / "metrics.1.jsonl").read_text() == earlier
    assert (run_dir / "trace.1.json").read_text() == "{}"
    assert (run_dir / "recipe.1.yaml").read_text() == "run: {}\n"
    assert json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    assert [r.getMessage() for r in caplog.records if r.name == "stages.run_dir"] == [
        f"{run_dir} holds an earlier run with no checkpoint to resume: this run starts afresh; the "
        "earlier files are kept (trace.json -> trace.1.json, recipe.yaml -> recipe.1.yaml, "
        "metrics.jsonl -> metrics.1.jsonl)"
    ]


async def test_resuming_a_finished_run_with_more_steps_trains_them_and_keeps_the_first_trace(
    tmp_path: Path, fake: FakeTime
) -> None:
    await run(make_recipe(tmp_path, steps=2), fake)
    run_dir = tmp_path / "run"
    first_trace = (run_dir / "trace.json").read_text()
    trainer = FakeTrainer(time=fake)
    summary = await run(make_recipe(tmp_path, steps=4), fake, trainer)
    assert summary.steps_done == 4
    assert len(trainer.steps) == 4  # two restored, two trained
    assert [m["step"] for m in metrics(make_recipe(tmp_path))] == [1, 2, 3, 4]
    assert (run_dir / "trace.1.json").read_text() == first_trace
    assert "steps: 2" in (run_dir / "recipe.1.yaml").read_text()
    assert "steps: 4" in (run_dir / "recipe.yaml").read_text()


async def test_resuming_with_no_steps_left_is_an_error_that_changes_nothing(
    tmp_path: Path, fake: FakeTime
) -> None:
    await run(make_recipe(tmp_path, steps=3), fake)
    run_dir = tmp_path / "run"
    before = {name: (run_dir / name).read_bytes() for name in ("trace.json", "recipe.yaml", "metrics.jsonl")}
    with pytest.raises(RecipeError) as raised:
        await run(make_recipe(tmp_path, steps=2), fake)
    assert str(raised.value) == (
        f"run.steps: 2, but the run in {run_dir} has trained 3 steps (checkpoint step-000003); "
        "set run.steps above 3 to train more, or choose another run.dir"
    )
    assert {name: (run_dir / name).read_bytes() for name in before} == before
    assert "trace.1.json" not in files(run_dir)


async def test_an_override_a_resume_would_ignore_is_an_error_naming_the_field(
    tmp_path: Path, fake: FakeTime
) -> None:
    await run(make_recipe(tmp_path, steps=2), fake)
    with pytest.raises(RecipeError) as raised:
        await run(make_recipe(tmp_path, steps=4, train={"lr": 1.0e-3}), fake)
    assert str(raised.value) == (
        f"train.lr: differs from checkpoint {tmp_path / 'run/checkpoints/step-000002'} (was 0.0003, "
        "now 0.001); resume with the recipe the checkpoint was written with, or start a new run.dir"
    )


async def test_nothing_is_written_to_run_dir_before_the_run_has_loaded(
    tmp_path: Path, fake: FakeTime
) -> None:
    recipe = make_recipe(tmp_path, reward={"function": "no_such_module_xyz:score"})
    with pytest.raises(RecipeError):
        await run(recipe, fake)
    assert not Path(recipe.run.dir).exists()


# -- checkpoints that survive damage ----------------------------------------------------------


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:10])


def _nan_scale(path: Path) -> None:
    path.write_text(json.dumps({"steps": 2, "scale": math.nan}))


@pytest.mark.parametrize(
    ("name", "damage", "reason"),
    [
        ("trainer.json", _truncate, "trainer.json has 10 bytes, 26 were committed"),
        (
            "trainer.json",
            _nan_scale,  # as many bytes as before
            "trainer.json does not match its committed checksum (its bytes changed)",
        ),
        (
            "trainer.json",
            lambda p: p.write_text(p.read_text().replace("1.0", "2.0")),  # finite: it would load
            "trainer.json does not match its committed checksum (its bytes changed)",
        ),
        ("trainer.json", Path.unlink, "trainer.json is missing"),
        ("state.msgpack", lambda p: p.write_bytes(b"\x93garbled"), "state.msgpack has 8 bytes, "),
        ("recipe.yaml", Path.unlink, "recipe.yaml is missing"),
    ],
    ids=[
        "truncated-trainer",
        "nan-trainer",
        "garbled-finite-trainer",
        "missing-trainer",
        "garbled-state",
        "missing-recipe",
    ],
)
async def test_a_damaged_newest_checkpoint_is_reported_and_the_previous_one_resumed(
    tmp_path: Path, fake: FakeTime, caplog: pytest.LogCaptureFixture, name: str, damage: Any, reason: str
) -> None:
    await run(make_recipe(tmp_path, steps=2, checkpoint={"every_steps": 1}), fake)
    root = tmp_path / "run/checkpoints"
    damage(root / "step-000002" / name)
    caplog.clear()
    trainer = FakeTrainer(time=fake)
    summary = await run(make_recipe(tmp_path, steps=3, checkpoint={"every_steps": 1}), fake, trainer)
    assert summary.steps_done == 3
    assert len(trainer.steps) == 3  # one restored from step 1, two trained again
    assert [m["step"] for m in metrics(make_recipe(tmp_path))] == [1, 2, 3]
    (warning,) = [
        r.getMessage() for r in caplog.records if r.name == "stages.checkpoint" and r.levelno >= logging.WARN
    ]
    assert warning.startswith(f"checkpoint {root / 'step-000002'} is damaged ({reason}")
    assert warning.endswith("; trying the one before it")
    assert (root / "damaged-step-000002").is_dir()
    assert [p.name for p in committed(root)] == ["step-000002", "step-000003"]


async def test_a_part_that_finds_its_file_damaged_falls_back_without_checksums(
    tmp_path: Path, fake: FakeTime, caplog: pytest.LogCaptureFixture
) -> None:
    """A marker written before checksums lists bare names: the part's own load still refuses a
    non-finite state, and the resume falls back."""
    await run(make_recipe(tmp_path, steps=2, checkpoint={"every_steps": 1}), fake)
    newest = tmp_path / "run/checkpoints/step-000002"
    names = [line.split("\t")[0] for line in (newest / MARKER).read_text().splitlines()]
    (newest / MARKER).write_text("".join(f"{name}\n" for name in names))
    _nan_scale(newest / "trainer.json")
    summary = await run(make_recipe(tmp_path, steps=3, checkpoint={"every_steps": 1}), fake)
    assert summary.steps_done == 3
    (warning,) = [
        r.getMessage() for r in caplog.records if r.name == "stages.checkpoint" and r.levelno >= logging.WARN
    ]
    assert "is damaged (trainer.json holds non-finite values at scale)" in warning


async def test_the_same_step_damaged_twice_still_resumes(tmp_path: Path, fake: FakeTime) -> None:
    root = tmp_path / "run/checkpoints"
    await run(make_recipe(tmp_path, steps=2, checkpoint={"every_steps": 1, "keep_last": 3}), fake)
    _truncate(root / "step-000002/trainer.json")
    await run(make_recipe(tmp_path, steps=3, checkpoint={"every_steps": 1, "keep_last": 3}), fake)
    for step in (2, 3):  # step 2 again, as trained the second time
        _truncate(root / f"step-00000{step}/trainer.json")
    summary = await run(make_recipe(tmp_path, steps=4, checkpoint={"every_steps": 1, "keep_last": 3}), fake)
    assert summary.steps_done == 4
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("damaged-")) == [
        "damaged-step-000002",
        "damaged-step-000002.2",
        "damaged-step-000003",
    ]


async def test_a_resume_from_an_older_checkpoint_sets_the_abandoned_branch_aside(
    tmp_path: Path, fake: FakeTime, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "run/checkpoints"
    keep = {"every_steps": 1, "keep_last": 4}
    await run(make_recipe(tmp_path, steps=4, checkpoint=keep), fake)
    caplog.set_level(logging.INFO)
    caplog.clear()
    older = {**keep, "resume": str(root / "step-000002")}
    await run(make_recipe(tmp_path, steps=3, checkpoint=older), fake)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning == (
        f"resumed from {root / 'step-000002'} (step 2): set aside the checkpoints of the abandoned "
        "branch, which checkpoint.resume: auto would have continued from: "
        "step-000003 -> abandoned-step-000003, step-000004 -> abandoned-step-000004"
    )
    assert [p.name for p in committed(root)] == ["step-000001", "step-000002", "step-000003"]
    caplog.clear()
    trainer = FakeTrainer(time=fake)
    await run(make_recipe(tmp_path, steps=5, checkpoint=keep), fake, trainer)
    assert len(trainer.steps) == 5  # three restored from this branch's step 3, two trained
    resumed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resumed from")]
    assert resumed[0].startswith(f"resumed from {root / 'step-000003'} (step 3)")
    assert [m["step"] for m in metrics(make_recipe(tmp_path))] == [1, 2, 3, 4, 5]


async def test_an_evaluation_lost_to_a_kill_runs_again_on_resume(tmp_path: Path, fake: FakeTime) -> None:
    """A kill during the evaluation of a checkpointed step leaves eval.jsonl without that step
    (a line cut short is dropped); the resumed run evaluates it before training on."""
    sections = {"checkpoint": {"every_steps": 2}, "eval": {"every_steps": 2, "num_prompts": 2}}
    await run(make_recipe(tmp_path, steps=2, **sections), fake)
    path = tmp_path / "run/eval.jsonl"
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 2]
    path.write_text(lines[0] + "\n" + lines[1][:20])
    await run(make_recipe(tmp_path, steps=4, **sections), fake)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 2, 4]


async def test_when_every_checkpoint_is_damaged_the_run_says_so(tmp_path: Path, fake: FakeTime) -> None:
    await run(make_recipe(tmp_path, steps=2, checkpoint={"every_steps": 1}), fake)
    root = tmp_path / "run/checkpoints"
    for checkpoint in committed(root):
        _truncate(checkpoint / "trainer.json")
    with pytest.raises(PipelineError) as raised:
        await run(make_recipe(tmp_path, steps=3), fake)
    assert str(raised.value) == (
        f"no usable checkpoint in {root}: every committed one is damaged (see the warnings above); "
        "move checkpoints/ away to start afresh"
    )


async def test_a_non_finite_state_is_never_saved_over_the_last_good_one(
    tmp_path: Path, fake: FakeTime
) -> None:
    recipe = make_recipe(tmp_path, steps=4, checkpoint={"every_steps": 1, "keep_last": 2})
    trainer = FakeTrainer(time=fake, nonfinite_state_from=3)
    with pytest.raises(CheckpointError) as raised:
        await run(recipe, fake, trainer)
    root = tmp_path / "run/checkpoints"
    assert str(raised.value) == (
        f"checkpoint: saving step 3 to {root / 'step-000003'} failed: trainer.json would hold non-finite "
        f"values at scale; the last good checkpoint is {root / 'step-000002'}"
    )
    assert [p.name for p in committed(root)] == ["step-000001", "step-000002"]
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []


async def test_a_failed_save_reports_its_own_error_and_clean_up_cannot_mask_it(
    tmp_path: Path, fake: FakeTime, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def full_disk(point: str) -> None:
        if point == "before_files":
            raise OSError(28, "No space left on device")

    def trace_on_full_disk(self: Trace, path: Path, snapshot: Any = None) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Trace, "write", trace_on_full_disk)
    recipe = make_recipe(tmp_path, steps=2)
    with pytest.raises(CheckpointError) as raised:
        await run(recipe, fake, checkpoint_hook=full_disk)
    root = tmp_path / "run/checkpoints"
    assert str(raised.value) == (
        f"checkpoint: saving step 2 to {root / 'step-000002'} failed: [Errno 28] No space left on "
        "device; the last good checkpoint is none"
    )
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [
        "writing trace.json failed too, after the run's error: OSError: [Errno 28] No space left on device"
    ]


async def test_a_checkpoint_folder_that_cannot_be_written_fails_at_the_start(
    tmp_path: Path, fake: FakeTime
) -> None:
    recipe = make_recipe(tmp_path, steps=2)
    run_dir = Path(recipe.run.dir)
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("")  # a file where the folder should be
    trainer = FakeTrainer(time=fake)
    with pytest.raises(CheckpointError) as raised:
        await run(recipe, fake, trainer)
    assert str(raised.value).startswith(f"checkpoint: cannot write to {run_dir / 'checkpoints'}: ")
    assert str(raised.value).endswith("; make it writable or choose another run.dir")
    assert trainer.steps == []


async def test_a_fatal_error_saves_the_last_consistent_step(tmp_path: Path, fake: FakeTime) -> None:
    injector = FaultInjector("train", 2)
    trainer = FakeTrainer(time=fake, on_step=lambda step, _: injector.check("train", step))
    with pytest.raises(StageFailed):
        await run(make_recipe(tmp_path, steps=5), fake, trainer)
    assert [p.name for p in committed(tmp_path / "run/checkpoints")] == ["step-000002"]


async def test_a_save_that_fails_on_cancellation_does_not_replace_the_cancellation(
    tmp_path: Path, fake: FakeTime, caplog: pytest.LogCaptureFixture
) -> None:
    two_steps = anyio.Event()

    def on_step(step: int, samples: Any) -> None:
        if step == 2:
            two_steps.set()

    trainer = FakeTrainer(time=fake, latency=10.0, on_step=on_step, nonfinite_state_from=1)
    engine = FakeEngine(time=fake, latency=1.0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(fake.autojump)
        async with anyio.create_task_group() as run_group:
            recipe = make_recipe(tmp_path, steps=1000)
            run_group.start_soon(
                lambda: run_program(recipe, engine=engine, trainer=trainer, time_source=fake)
            )
            await two_steps.wait()
            run_group.cancel_scope.cancel()
        tg.cancel_scope.cancel()
    (error,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert error.startswith(
        "the save on cancellation failed too, after the run's error: CheckpointError: checkpoint: saving "
    )
    assert error.endswith(
        "failed: trainer.json would hold non-finite values at scale; the last good checkpoint is none"
    )
