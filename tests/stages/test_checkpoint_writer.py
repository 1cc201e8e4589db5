"""Asynchronous saves on fakes: one write in flight (a save due meanwhile waits, and says so),
a failing write stops the run with the last good checkpoint intact."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from test_flow import make_recipe, metrics
from test_run_dir import run

from pipeline.testing import FakeTime, FakeTrainer
from stages.checkpoint import CheckpointError, committed


@pytest.fixture
def fake() -> FakeTime:
    return FakeTime()


def writer_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("checkpoint-")]


class Points:
    """The checkpoint hook's points in order, each tagged with its save's number (from 1)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, str]] = []

    def __call__(self, point: str) -> None:
        number = len([p for _, p in self.seen if p == "before_snapshot"]) + (point == "before_snapshot")
        self.seen.append((number, point))


async def test_a_save_due_while_the_last_write_runs_waits_for_it_and_says_so(
    tmp_path: Path, fake: FakeTime, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stages.checkpoint")
    waiting = threading.Event()

    class Waits(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waits for the previous checkpoint's write" in record.getMessage():
                waiting.set()

    points = Points()

    def hook(point: str) -> None:
        points(point)
        if points.seen[-1] == (1, "before_marker"):
            # The first write holds until the second save is due: two writes would overlap
            # here, were the second not made to wait.
            assert waiting.wait(timeout=60), "the second save did not wait for the first write"

    handler = Waits()
    logging.getLogger("stages.checkpoint").addHandler(handler)
    try:
        recipe = make_recipe(tmp_path, steps=3, checkpoint={"every_steps": 1, "keep_last": 3})
        await run(recipe, fake, checkpoint_hook=hook)
    finally:
        logging.getLogger("stages.checkpoint").removeHandler(handler)
    assert "the save of step 2 waits for the previous checkpoint's write" in caplog.messages
    # Each save's points in order, none interleaved with another's.
    assert [n for n, _ in points.seen] == sorted(n for n, _ in points.seen)
    assert [p.name for p in committed(tmp_path / "run/checkpoints")] == [
        "step-000001",
        "step-000002",
        "step-000003",
    ]
    lines = {m["step"]: m for m in metrics(recipe)}
    assert all("timing/save_wait_s" in lines[step] for step in (1, 2, 3))
    assert "timing/save_write_s" in lines[2]  # step 1's write, finished before step 2's snapshot
    trace = json.loads((tmp_path / "run/trace.json").read_text())["traceEvents"]
    track = next(e["tid"] for e in trace if e["name"] == "thread_name" and e["args"]["name"] == "checkpoint")
    assert [e["name"] for e in trace if e.get("tid") == track and e["ph"] == "X"] == [
        "write step 1",
        "write step 2",
        "write step 3",
    ]
    assert writer_threads() == []


async def test_a_failing_background_write_stops_the_run_and_keeps_the_last_good_checkpoint(
    tmp_path: Path, fake: FakeTime
) -> None:
    points = Points()
    failed = threading.Event()

    def full_disk(point: str) -> None:
        points(point)
        if points.seen[-1] == (2, "after:trainer.json"):  # step 6's checkpoint
            failed.set()
            raise OSError(28, "No space left on device")

    def step(index: int, groups: Any) -> None:
        if index == 6:  # step 7 trains once the write has failed (fake time outruns the thread)
            assert failed.wait(timeout=60)
            deadline = time.monotonic() + 60
            while writer_threads() and time.monotonic() < deadline:  # its failure kept, not only raised
                time.sleep(0.005)

    recipe = make_recipe(tmp_path, steps=9, checkpoint={"every_steps": 3})
    with pytest.raises(CheckpointError) as raised:
        await run(recipe, fake, FakeTrainer(time=fake, on_step=step), checkpoint_hook=full_disk)
    root = tmp_path / "run/checkpoints"
    assert str(raised.value) == (
        f"checkpoint: saving step 6 to {root / 'step-000006'} failed: [Errno 28] No space left on "
        f"device; the last good checkpoint is {root / 'step-000003'}"
    )
    assert [p.name for p in root.iterdir()] == ["step-000003"]  # nothing of step 6 left
    # Stopped at the step after the failure (7 or 8: it fails during step 7's training at the
    # latest), not at the next save (9) nor at the end.
    assert max(m["step"] for m in metrics(recipe)) in (6, 7)
    assert [n for n, p in points.seen if p == "before_snapshot"] == [1, 2]
    assert writer_threads() == []


async def test_a_clean_stop_waits_for_the_write_in_flight(tmp_path: Path, fake: FakeTime) -> None:
    """The last step's write is in the background when the stages end: the run returns only
    once it is committed."""
    returned = threading.Event()
    seen_returned: list[bool] = []

    def hook(point: str) -> Any:
        if point == "before_rename":
            # Set only once the run has returned: were it not waiting for this write, it would
            # return meanwhile. Waiting, the run holds this write until the timeout.
            seen_returned.append(returned.wait(timeout=1.0))

    await run(make_recipe(tmp_path, steps=2), fake, checkpoint_hook=hook)
    returned.set()
    assert seen_returned == [False]
    assert [p.name for p in committed(tmp_path / "run/checkpoints")] == ["step-000002"]


async def test_a_failing_write_of_the_last_step_fails_the_run(tmp_path: Path, fake: FakeTime) -> None:
    """The last step's write is the one no later step checks: the run's end must raise its
    failure, or the run says it finished with nothing of its last step saved."""

    def full_disk(point: str) -> None:
        if point == "before_marker":
            raise OSError(28, "No space left on device")

    with pytest.raises(CheckpointError) as raised:
        await run(make_recipe(tmp_path, steps=2), fake, checkpoint_hook=full_disk)
    root = tmp_path / "run/checkpoints"
    assert str(raised.value) == (
        f"checkpoint: saving step 2 to {root / 'step-000002'} failed: [Errno 28] No space left on "
        "device; the last good checkpoint is none"
    )
    assert committed(root) == []


async def test_each_commit_writes_the_trace_so_far(tmp_path: Path, fake: FakeTime) -> None:
    """A run killed after a checkpoint still leaves trace.json: each commit writes the trace as
    of its snapshot. Seen from the next save, which starts once the last write is done."""
    trace = tmp_path / "run/trace.json"
    seen: list[bool] = []

    def hook(point: str) -> None:
        if point == "before_snapshot":
            seen.append(trace.is_file())

    await run(make_recipe(tmp_path, steps=3, checkpoint={"every_steps": 1}), fake, checkpoint_hook=hook)
    assert seen == [False, True, True]
