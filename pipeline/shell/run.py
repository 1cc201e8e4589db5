"""Runs a recipe: the shell's side of `stages.program.run_program`, which it gives the recipe's
checks and backend (`start_backend`), and the report it draws once the run has ended."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from backends.place import place
from backends.placement import Placed
from pipeline.shell.backend_input import backend_input
from pipeline.shell.plot import draw_apart
from pipeline.shell.preflight import Checked, preflight
from pipeline.shell.recipe import Recipe
from stages import program

log = logging.getLogger("pipeline.shell.run")


async def run_program(recipe: Recipe, **options: Any) -> program.RunSummary:
    """`stages.program.run_program` with this recipe's backend; then `report.png` (run.plot)."""
    summary = await program.run_program(recipe, start=start_backend, **options)
    if recipe.run.plot:
        problem = await draw_apart(Path(recipe.run.dir))
        if problem:  # the run is done and saved: a missing plot is not a failure
            log.warning("run.plot: no report.png: %s", problem)
    return summary


def start_backend(recipe: Recipe, build: bool) -> tuple[Checked, Placed | None]:
    """The recipe's checks, then (with `build`) the recipe's backend where `placement` says; on
    a worker thread."""
    checked = preflight(recipe, model=build, resume=False)  # open_resume read it whole
    if not build:
        return checked, None
    tokenizer = checked.prompts.tokenizer
    spec = backend_input(recipe, checked.algorithm)  # the backend's one input: never the recipe
    return checked, place(spec, vocab_size=tokenizer.vocab_size, stop_ids=tokenizer.stop_ids)
