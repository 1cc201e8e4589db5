"""An asynchronous GRPO trainer built as an asyncio pipeline.

Embedding API (works inside an already running event loop):

    recipe = pipeline.load_recipe("recipes/quickstart.yaml", overrides=["run.steps=20"])
    summary = await pipeline.run(recipe)

Importing this package imports no torch, ray or megatron: the compute is loaded by `run`.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.contracts.errors import PipelineError, RecipeError
from pipeline.runner import StopRequest

if TYPE_CHECKING:
    from pipeline.shell.recipe import Recipe
    from stages.program import RunSummary

__all__ = ["PipelineError", "RecipeError", "StopRequest", "load_recipe", "run"]


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Read and validate a recipe; raises `RecipeError` naming the file and field."""
    from pipeline import recipe as loader
    from pipeline.shell.recipe import Recipe

    return loader.load(path, Recipe, overrides)


async def run(recipe: Recipe, **options: Any) -> RunSummary:
    """Run the pipeline for `recipe` in the current event loop; returns a `RunSummary`.

    Cancelling the awaiting task stops the pipeline and leaves no task running. Pass
    `stop=StopRequest()` to ask for a clean stop (admission closes, in-flight work drains).
    """
    import asyncio

    from pipeline.startup import cache_bytecode, say, start_up

    say("starting a run of %d steps in %s", recipe.run.steps, recipe.run.dir)

    def load() -> Any:
        cache_bytecode(("pipeline", "stages", "backends"))
        # anyio imports its asyncio backend at its first use, a tenth of a second of imports:
        # here, with the stages' modules, off the event loop, so the host keeps its turns.
        importlib.import_module("anyio._backends._asyncio")
        return importlib.import_module("pipeline.shell.run")

    with start_up():
        program = await asyncio.to_thread(load)
    return await program.run_program(recipe, **options)
