"""Compute backends by the name `train.backend` gives them, each module imported only when chosen.

A backend is a module with

    build_backend(recipe, *, vocab_size: int, stop_ids: Sequence[int]) -> tuple[Engine, Trainer]

that builds the run's engine and trainer from the recipe (the trainer, and an engine with state,
also `Checkpointable`), and

    build_trainer_alone(recipe, *, vocab_size: int) -> Trainer

that builds the trainer alone, for a process whose engines run elsewhere (a Ray trainer actor:
one a rank), and

    build_engine_alone(recipe, *, vocab_size: int, stop_ids: Sequence[int], replica: int) -> Engine

that builds one engine replica alone, on weights of its own that a refit refreshes (a Ray engine
actor), whose trainer's `served_parameters()` are the weights an engine's torch `Decoder` takes
(its names and layout); a bad recipe raises `RecipeError` naming the field. A backend that
refuses some recipes also gives `check(recipe)`, which raises that error without building (the
pre-flight checks of `validate` and `run` call it). Its recipe sections
live beside it (`backends/torch/section.py`). Importing this module imports no backend, so
`pipeline/` and `stages/` stay free of torch until a run builds one. To add a backend, add its
name to `BackendName` and its module to `BACKENDS`.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, get_args

from pipeline.contracts.protocols import Engine, Trainer
from pipeline.contracts.sections import BackendName

BACKENDS: dict[str, str] = {"torch": "backends.torch.build", "megatron": "backends.megatron.build"}
assert set(BACKENDS) == set(get_args(BackendName)), "a backend named in one place only"


def check(recipe: Any) -> None:
    """The recipe refusals of the backend `recipe.train.backend` names (its module's `check`, if
    it has one), without building anything: `validate` runs them as `run` does."""
    module = importlib.import_module(BACKENDS[recipe.train.backend])
    if (refuse := getattr(module, "check", None)) is not None:
        refuse(recipe)


def build_trainer_alone(recipe: Any, *, vocab_size: int) -> Trainer:
    """The trainer alone, of the backend `recipe.train.backend` names: this process's rank of it,
    where its engines run elsewhere (a Ray trainer actor)."""
    module = importlib.import_module(BACKENDS[recipe.train.backend])
    trainer: Trainer = module.build_trainer_alone(recipe, vocab_size=vocab_size)
    return trainer


def build_backend(recipe: Any, *, vocab_size: int, stop_ids: Sequence[int]) -> tuple[Engine, Trainer]:
    """The (engine, trainer) pair of the backend `recipe.train.backend` names."""
    module = importlib.import_module(BACKENDS[recipe.train.backend])
    engine, trainer = module.build_backend(recipe, vocab_size=vocab_size, stop_ids=stop_ids)
    return engine, trainer


def build_engine_alone(recipe: Any, *, vocab_size: int, stop_ids: Sequence[int], replica: int = 0) -> Engine:
    """Engine replica `replica` alone, of the backend `recipe.train.backend` names, on weights of
    its own that a refit refreshes (a Ray engine actor, apart from the trainer)."""
    module = importlib.import_module(BACKENDS[recipe.train.backend])
    engine: Engine = module.build_engine_alone(
        recipe, vocab_size=vocab_size, stop_ids=stop_ids, replica=replica
    )
    return engine
