"""The run's lifecycle (`stages.program`): what start-up builds is let go of however it ends."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import anyio
import pytest

import pipeline
from backends.placement import Placed
from pipeline.shell.recipe import Recipe
from pipeline.shell.run import start_backend
from pipeline.testing import FakeEngine, FakeTrainer
from stages import program

QUICKSTART = Path(__file__).parents[2] / "recipes" / "quickstart.yaml"


async def test_a_run_cancelled_while_its_backend_builds_closes_it_once_built(tmp_path: Path) -> None:
    """A host's `task.cancel()` ends the awaiting task at once while the start-up thread builds
    on; what that thread then returns is closed (it was left running: a model, or Ray's runtime
    and actors, for the rest of the host's life)."""
    recipe = pipeline.load_recipe(QUICKSTART, [f"run.dir={tmp_path / 'run'}", "eval.every_steps=0"])
    building, finish, closed = threading.Event(), threading.Event(), threading.Event()

    def start(recipe: Recipe, build: bool) -> tuple[object, Placed]:
        checked, _ = start_backend(recipe, False)  # the recipe's real checks; the build is held
        building.set()
        finish.wait()
        return checked, Placed(engine=FakeEngine(), trainer=FakeTrainer(), close=closed.set)

    task = asyncio.create_task(program.run_program(recipe, start=start))  # type: ignore[arg-type]
    await anyio.to_thread.run_sync(building.wait)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not closed.is_set()
    finish.set()  # the build ends after the run did
    assert await anyio.to_thread.run_sync(closed.wait, 60.0)
