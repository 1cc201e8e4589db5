"""Checkpoints: exact resume, exactly-once prompts, kills during a save, clean stops; what counts
as committed, and a re-save of the same step."""

from __future__ import annotations

import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

import pipeline
from pipeline.channel import Channel
from pipeline.contracts.messages import Group, TrainGroup
from pipeline.metrics import read
from pipeline.runner import StopRequest
from pipeline.shell.run import run_program
from pipeline.testing import FakeEngine, FakeTrainer
from stages.checkpoint import MARKER, STATE_FILE, Checkpointer, PipelineState, committed, newest, read_saved

KEYS = ("train/loss", "train/grad_norm", "reward/mean")
SMALL = [
    "run.progress=false",
    "eval.every_steps=0",
    "async_rl.max_lookahead_versions=0",
    "prompts.prompts_per_step=8",
]


def _recipe(run_dir: Path, *overrides: str) -> Any:
    return pipeline.load_recipe("recipes/quickstart.yaml", [f"run.dir={run_dir}", *SMALL, *overrides])


def _figures(run_dir: Path) -> dict[int, tuple[str, ...]]:
    return {
        r["step"]: tuple(float(r[k]).hex() for k in KEYS)
        for r in read(run_dir / "metrics.jsonl")
        if "train/loss" in r
    }


def _run_stopping_after(recipe: Any, step: int) -> None:
    stop = StopRequest()

    def echo(record: dict[str, Any]) -> None:
        if record.get("step") == step:
            stop.request("test stop")

    anyio.run(lambda: pipeline.run(recipe, stop=stop, echo=echo))


def _kill_after_first_checkpoint(args: list[str], run_dir: Path) -> int:
    """Run `args`, SIGKILL it at a random moment up to 0.3 s after `run_dir`'s first committed
    checkpoint; its exit status (-SIGKILL where the kill came before it ended)."""
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600  # a hang guard: a loaded machine starts and steps slowly
    while not committed(run_dir / "checkpoints") and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.01)
    time.sleep(random.uniform(0.0, 0.3))
    process.send_signal(signal.SIGKILL)
    return process.wait()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[str, ...]]:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    anyio.run(pipeline.run, _recipe(run_dir, "run.steps=6"))
    return _figures(run_dir)


def test_stop_and_resume_is_bit_exact(tmp_path: Path, uninterrupted: dict[int, tuple[str, ...]]) -> None:
    run_dir = tmp_path / "run"
    _run_stopping_after(_recipe(run_dir, "run.steps=6"), 3)
    # Work admitted before the stop drains (with L = 0, at most the next batch).
    assert [p.name for p in committed(run_dir / "checkpoints")] in (["step-000003"], ["step-000004"])
    anyio.run(pipeline.run, _recipe(run_dir, "run.steps=6"))
    assert _figures(run_dir) == uninterrupted


def test_sigkill_after_a_save_then_resume_is_bit_exact(
    tmp_path: Path, uninterrupted: dict[int, tuple[str, ...]]
) -> None:
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "pipeline", "run", "recipes/quickstart.yaml", f"run.dir={run_dir}", *SMALL]
    args += ["run.steps=6", "checkpoint.every_steps=1", "--quiet"]
    _kill_after_first_checkpoint(args, run_dir)
    anyio.run(pipeline.run, _recipe(run_dir, "run.steps=6"))
    assert _figures(run_dir) == uninterrupted


KILL_SCRIPT = """
import os, sys, anyio, pipeline
from pipeline.shell.run import run_program
point, nth = sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 2
saves = []
def hook(where):  # each save's points run in order, after the last save's write (one in flight)
    if where == "before_snapshot":
        saves.append(1)
    if len(saves) == nth and where == point:
        os._exit(9)
recipe = pipeline.load_recipe("recipes/quickstart.yaml", [f"run.dir={sys.argv[1]}", "run.progress=false",
    "eval.every_steps=0", "prompts.prompts_per_step=4", "run.steps=4", "checkpoint.every_steps=1"])
anyio.run(lambda: run_program(recipe, checkpoint_hook=hook))
"""


@pytest.mark.parametrize(
    ("point", "nth", "left"),
    [
        ("before_snapshot", 2, [1]),
        # in the background write, while the next steps train
        ("before_files", 2, [1]),
        ("after:trainer.pt", 2, [1]),
        ("after:engine.pt", 2, [1]),
        ("before_marker", 2, [1]),
        ("before_rename", 2, [1]),
        ("purge:step-000001", 3, [1, 2, 3]),  # retention (keep_last 2), after step 3's commit
    ],
)
def test_a_kill_during_a_save_leaves_the_previous_checkpoint_intact(
    tmp_path: Path, point: str, nth: int, left: list[int]
) -> None:
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(run_dir), point, str(nth)], check=False)
    assert done.returncode == 9
    found = committed(run_dir / "checkpoints")
    assert [p.name for p in found] == [f"step-{step:06d}" for step in left]
    assert (found[-1] / MARKER).read_text().splitlines()[0] == str(left[-1])
    # Resume cleans the orphan and continues from step 1 to the end.
    summary = anyio.run(pipeline.run, pipeline.load_recipe(str(run_dir / "recipe.yaml")))
    assert summary.steps_done == 4
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp")]
    assert [r["step"] for r in read(run_dir / "metrics.jsonl") if "train/loss" in r] == [1, 2, 3, 4]


@pytest.mark.parametrize("recipe_path", ["recipes/quickstart.yaml", "recipes/multi-turn-cpu.yaml"])
def test_every_prompt_is_trained_exactly_once_across_stop_and_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recipe_path: str
) -> None:
    trained: list[str] = []
    scored: dict[str, Group] = {}  # the latest group sent under each id (a resume regenerates some)
    original_send = Channel.send

    async def spy(self: Channel[Any], item: Any) -> None:
        if self.name == "scored" and isinstance(item, Group):
            scored[item.group_id] = item
        await original_send(self, item)

    monkeypatch.setattr(Channel, "send", spy)

    def record(step: int, groups: Sequence[TrainGroup]) -> None:
        trained.extend(sorted({scored[g.group_id].prompt.prompt_id for g in groups}))

    overrides = ["async_rl.max_lookahead_versions=2", "run.steps=8", "prompts.prompts_per_step=3"]
    recipe = pipeline.load_recipe(
        recipe_path, [f"run.dir={tmp_path / 'run'}", "run.progress=false", "run.plot=false", *overrides]
    )
    stop = StopRequest()

    def echo(record_: dict[str, Any]) -> None:
        if record_.get("step") == 3:
            stop.request("test stop")

    async def first() -> None:
        await run_program(
            recipe, engine=FakeEngine(), trainer=FakeTrainer(on_step=record), stop=stop, echo=echo
        )

    anyio.run(first)
    stopped_at = len(trained)
    assert 3 * 3 <= stopped_at < 8 * 3
    summary = anyio.run(lambda: run_program(recipe, engine=FakeEngine(), trainer=FakeTrainer(on_step=record)))
    assert summary.steps_done == 8
    assert len(trained) == len(set(trained)) == 8 * 3
    assert set(trained) == {f"train-{i}" for i in range(8 * 3)}


# Runs a recipe with the real backend, appending to a log file, as each step starts training,
# "<step> <prompt id> ..." of the prompts it trains (flushed line by line: a kill loses none).
RECORDING_SCRIPT = """
import sys, anyio, pipeline
from pipeline.channel import Channel
from pipeline.contracts.messages import Group
from pipeline.shell import run as shell_run
log = open(sys.argv[2], "a", buffering=1)
prompt_of, send, place = {}, Channel.send, shell_run.place
async def spy(self, item):
    if self.name == "scored" and isinstance(item, Group):
        prompt_of[item.group_id] = item.prompt.prompt_id
    await send(self, item)
def placing(*args, **kwargs):
    placed = place(*args, **kwargs)
    trainer, step = placed.trainer, placed.trainer.train_step
    async def recording(groups):
        ids = [prompt_of[g.group_id] for g in groups]
        log.write(" ".join([str(trainer.completed_steps + 1), *ids]) + "\\n")
        return await step(groups)
    trainer.train_step = recording
    return placed
Channel.send, shell_run.place = spy, placing
recipe = pipeline.load_recipe(sys.argv[3], [f"run.dir={sys.argv[1]}", *sys.argv[4:]])
anyio.run(shell_run.run_program, recipe)
"""


def test_sigkill_then_resume_trains_every_prompt_exactly_once_multi_turn_included(tmp_path: Path) -> None:
    """The multi-turn recipe (the guess environment, L = 1: a batch generated ahead of the one
    training) killed at a random moment after its first checkpoint, then resumed: the steps the
    checkpoint kept and the resumed run's steps train every prompt once."""
    run_dir, log = tmp_path / "run", tmp_path / "trained.log"
    steps, per_step = 6, 4
    args = [sys.executable, "-c", RECORDING_SCRIPT, str(run_dir), str(log), "recipes/multi-turn-cpu.yaml"]
    args += ["run.progress=false", "run.plot=false", "eval.every_steps=0", "gates.checks=[]"]
    args += [f"run.steps={steps}", f"prompts.prompts_per_step={per_step}", "checkpoint.every_steps=1"]
    assert _kill_after_first_checkpoint(args, run_dir) == -signal.SIGKILL
    kept = int(committed(run_dir / "checkpoints")[-1].name.removeprefix("step-"))
    assert kept < steps
    before = [line.split() for line in log.read_text().splitlines()]
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = [line.split() for line in log.read_text().splitlines()[len(before) :]]
    trained = [line for line in before if int(line[0]) <= kept] + after
    assert [int(step) for step, *_ in trained] == list(range(1, steps + 1))
    prompts = [prompt for _, *ids in trained for prompt in ids]
    assert sorted(prompts) == sorted(f"train-{i}" for i in range(steps * per_step))


def test_resume_never_refuses_a_used_run_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    anyio.run(pipeline.run, _recipe(run_dir, "run.steps=1"))
    with pytest.raises(pipeline.RecipeError) as error:
        anyio.run(pipeline.run, _recipe(run_dir, "run.steps=2", "checkpoint.resume=never"))
    assert str(error.value) == (
        f"checkpoint.resume: run.dir {run_dir} is not empty and resume is 'never'; "
        "choose another run.dir or set checkpoint.resume: auto"
    )


def test_resume_with_a_changed_model_names_the_field(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    anyio.run(pipeline.run, _recipe(run_dir, "run.steps=1"))
    with pytest.raises(pipeline.RecipeError, match=r"^model: differs from checkpoint"):
        anyio.run(pipeline.run, _recipe(run_dir, "run.steps=2", "model.config.hidden_size=64"))


def test_a_kill_right_after_a_save_keeps_that_steps_metrics(tmp_path: Path) -> None:
    # The checkpoint is written in the background while the step goes on to write its metrics
    # line: a kill just after the rename may come before that line, which must not be lost, or
    # the resumed run would skip it for good (the checkpoint carries it).
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(run_dir), "after_rename"], check=False)
    assert done.returncode == 9
    assert [p.name for p in committed(run_dir / "checkpoints")][-1] == "step-000002"
    lost = 2 not in {r.get("step") for r in read(run_dir / "metrics.jsonl")}
    anyio.run(pipeline.run, pipeline.load_recipe(str(run_dir / "recipe.yaml")))
    records = [r for r in read(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[1].get("metrics/recovered") == (1 if lost else None)
    assert "metrics/recovered" not in records[2]


def test_a_checkpoint_from_before_a_new_recipe_field_still_resumes(tmp_path: Path) -> None:
    """A field added to the recipe since a checkpoint was written (here: the model config's
    `qk_norm`, `async_rl.handoff_checks`) takes its default: the resume is not refused as a
    changed model, while a field really changed still is."""
    import yaml

    run_dir = tmp_path / "run"
    anyio.run(pipeline.run, _recipe(run_dir, "run.steps=2"))
    (checkpoint,) = committed(run_dir / "checkpoints")
    saved = yaml.safe_load((checkpoint / "recipe.yaml").read_text())
    del saved["model"]["config"]["qk_norm"], saved["async_rl"]["handoff_checks"]
    (checkpoint / "recipe.yaml").write_text(yaml.safe_dump(saved))
    # As such a checkpoint was written: a marker naming its files, without their checksums.
    lines = (checkpoint / MARKER).read_text().splitlines()
    (checkpoint / MARKER).write_text("".join(line.split("\t")[0] + "\n" for line in lines))
    summary = anyio.run(pipeline.run, _recipe(run_dir, "run.steps=3"))
    assert summary.steps_done == 3
    with pytest.raises(pipeline.RecipeError, match=r"^model: differs from checkpoint"):
        anyio.run(pipeline.run, _recipe(run_dir, "run.steps=4", "model.config.hidden_size=64"))


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 1001, 4567])
def test_a_files_checksum_summed_in_pieces_is_the_whole_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    """A large file is summed in pieces on several threads and the pieces' CRC-32s combined:
    the result is zlib's CRC-32 of the whole file (pieces of 1000 bytes here)."""
    import zlib

    from stages import checkpoint_marker

    monkeypatch.setattr(checkpoint_marker, "_CHUNK", 1000)
    data = random.Random(size).randbytes(size)
    (tmp_path / "f").write_bytes(data)
    assert checkpoint_marker.checksum(tmp_path / "f") == zlib.crc32(data)


def test_a_checksum_reads_on_after_a_short_read_and_names_a_file_that_ended_early(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read may return fewer bytes than asked (network file systems do): the checksum reads
    on and is the whole file's; a file that ends before its size (truncated under the read)
    is an OSError naming it, which a resume reads as a damaged checkpoint."""
    import os
    import zlib

    from stages import checkpoint_marker

    monkeypatch.setattr(checkpoint_marker, "_CHUNK", 1000)
    data = random.Random(0).randbytes(4567)
    path = tmp_path / "f"
    path.write_bytes(data)
    preadv = os.preadv

    def short(fd: int, buffers: list[memoryview], offset: int) -> int:
        return preadv(fd, [buffers[0][:300]], offset)  # at most 300 bytes a call

    monkeypatch.setattr(os, "preadv", short)
    assert checkpoint_marker.checksum(path) == zlib.crc32(data)

    ended: list[int] = []

    def ends(fd: int, buffers: list[memoryview], offset: int) -> int:
        assert offset not in ended, "read again where the file had ended"
        if offset >= 4000:
            ended.append(offset)
            return 0
        return short(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", ends)
    with pytest.raises(OSError, match=rf"^{re.escape(str(path))}: shorter than its size while being read$"):
        checkpoint_marker.checksum(path)


def test_a_checkpoint_whose_recipe_is_not_a_mapping_is_damaged(tmp_path: Path) -> None:
    """Its files as committed (sizes and checksums match), but a recipe.yaml that is YAML and no
    recipe: the checkpoint is damaged (resume moves to the one before), not a crash later."""
    import msgspec

    from pipeline.contracts.errors import DamagedState
    from stages.checkpoint import RECIPE_FILE, STATE_FILE, PipelineState, flushed, read_saved
    from stages.checkpoint_marker import MARKER, marker_text

    saved = tmp_path / "step-000001"
    saved.mkdir()
    state = PipelineState(
        step=1, policy_version=1, next_batch=1, rollout_counts={}, reward_counts={}, python_rng=[]
    )
    (saved / STATE_FILE).write_bytes(msgspec.msgpack.encode(state))
    (saved / RECIPE_FILE).write_text("- a list\n")
    (saved / MARKER).write_text(marker_text(1, [flushed(saved, STATE_FILE), flushed(saved, RECIPE_FILE)]))
    with pytest.raises(DamagedState, match=f"^{RECIPE_FILE} is not a recipe$"):
        read_saved(saved)


class _Recipe(msgspec.Struct):
    """A recipe for `Checkpointer.save` (it only dumps it)."""

    name: str = "test"


def _save(checkpoints: Checkpointer, step: int, *, next_batch: int) -> Path:
    """A checkpoint of step `step` with no backend parts: the pipeline's own files only."""
    state = PipelineState(
        step=step,
        policy_version=step,
        next_batch=next_batch,
        rollout_counts={},
        reward_counts={},
        python_rng=[],
    )
    return checkpoints.save(step, [], state, _Recipe())


def test_a_step_directory_without_its_marker_is_not_committed(tmp_path: Path) -> None:
    """A copy of step 1 as step 2, cut short before its marker: not a checkpoint, so neither
    listed as committed nor the newest (a resume never picks it)."""
    root = tmp_path / "checkpoints"
    first = _save(Checkpointer(root, keep_last=3), 1, next_batch=1)
    unfinished = root / "step-000002"
    shutil.copytree(first, unfinished, ignore=shutil.ignore_patterns(MARKER))
    assert (unfinished / STATE_FILE).is_file()
    assert committed(root) == [first]
    assert newest(root) == first


def test_a_resave_of_the_same_step_replaces_its_checkpoint(tmp_path: Path) -> None:
    """Saving a step already committed replaces that checkpoint with the new state, leaving
    nothing else behind."""
    root = tmp_path / "checkpoints"
    checkpoints = Checkpointer(root, keep_last=3)
    first = _save(checkpoints, 1, next_batch=1)
    second = _save(checkpoints, 1, next_batch=5)
    assert second == first
    assert read_saved(second).state.next_batch == 5
    assert list(root.iterdir()) == [second]


class _Sharded:
    """A part that writes a folder of its own (as megatron's shards), later: `Snapshotting`.
    `fail`: its write raises that instead (a bug in a backend)."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail = fail

    def save(self, directory: Path) -> None:
        self.snapshot(directory).write()

    def snapshot(self, directory: Path) -> Any:
        part = self

        class Written:
            def write(self) -> None:
                if part.fail is not None:
                    raise part.fail
                (directory / "shards").mkdir()
                (directory / "shards" / "0.bin").write_bytes(b"\1" * 64)

        return Written()

    def load(self, directory: Path) -> None:
        pass


def test_a_save_is_on_disk_before_its_rename_and_its_rename_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What makes a save survive a power loss: every file, the marker and every folder of the
    step is fsynced before the rename that commits it, and the checkpoints folder (which holds
    the rename) after it. Deleting any of those fsyncs leaves every other test green, since only
    a machine that loses its page cache would tell."""
    import os

    root = tmp_path / "checkpoints"
    root.mkdir()
    events: list[str] = []
    fsync, rename = os.fsync, os.rename

    def fsynced(fd: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        events.append(f"fsync {path.relative_to(tmp_path)}")
        fsync(fd)

    def renamed(source: Any, target: Any) -> None:
        events.append(f"rename {Path(source).name} -> {Path(target).name}")
        rename(source, target)

    monkeypatch.setattr(os, "fsync", fsynced)
    monkeypatch.setattr(os, "rename", renamed)
    state = PipelineState(
        step=1, policy_version=1, next_batch=1, rollout_counts={}, reward_counts={}, python_rng=[]
    )
    Checkpointer(root, keep_last=2).save(1, [_Sharded()], state, _Recipe())
    tmp = f"checkpoints/.tmp-step-000001-{os.getpid()}"
    assert events == [
        f"fsync {tmp}/shards/0.bin",
        f"fsync {tmp}/{STATE_FILE}",
        f"fsync {tmp}/recipe.yaml",
        f"fsync {tmp}/{MARKER}",
        f"fsync {tmp}/shards",
        f"fsync {tmp}",
        f"rename .tmp-step-000001-{os.getpid()} -> step-000001",
        "fsync checkpoints",
    ]


def test_a_write_that_fails_by_a_bug_raises_it_and_leaves_no_folder_behind(tmp_path: Path) -> None:
    """A part's write that raises other than a full disk or a non-finite state (a bug) is raised
    as it is, and its unfinished folder goes with it (a run embedded in a long-lived process
    would otherwise keep it until its next start)."""
    root = tmp_path / "checkpoints"
    checkpoints = Checkpointer(root, keep_last=2)
    first = _save(checkpoints, 1, next_batch=1)
    state = PipelineState(
        step=2, policy_version=2, next_batch=2, rollout_counts={}, reward_counts={}, python_rng=[]
    )
    with pytest.raises(ZeroDivisionError):
        checkpoints.save(2, [_Sharded(fail=ZeroDivisionError())], state, _Recipe())
    assert list(root.iterdir()) == [first]


def test_a_steps_line_lost_to_a_kill_after_its_checkpoint_is_written_back_from_it(tmp_path: Path) -> None:
    """The kill test above reaches this only when the kill beats the step's line (it depends on
    the machine's speed): here the line is lost for certain, and the resume writes it back from
    the checkpoint, marked recovered, dropping what the killed run logged past the checkpoint."""
    import json

    from stages.checkpoint import restore_metrics

    lines = [{"step": 1, "train/loss": 0.5}, {"step": 3, "train/loss": 0.25}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    state = PipelineState(
        step=2,
        policy_version=2,
        next_batch=2,
        rollout_counts={},
        reward_counts={},
        last_record={"step": 2, "train/loss": 0.375},
        python_rng=[],
    )
    restore_metrics(tmp_path, state)
    assert read(tmp_path / "metrics.jsonl") == [
        {"step": 1, "train/loss": 0.5},
        {"step": 2, "train/loss": 0.375, "metrics/recovered": 1},
    ]
