"""Compute backends by the name `train.backend` gives them, each module imported only when chosen.

A backend is a module with

    build_backend(spec: Input, *, vocab_size: int, stop_ids: Sequence[int]) -> tuple[Engine, Trainer]

that builds the run's engine and trainer from the backend's typed input (`backends/input.py`,
built once from the recipe by the shell; never the recipe itself) (the trainer, and an engine with state,
also `Checkpointable`), and

    build_trainer_alone(spec, *, vocab_size: int) -> Trainer

that builds the trainer alone, for a process whose engines run elsewhere (a Ray trainer actor:
one a rank), and

    build_engine_alone(spec, *, vocab_size: int, stop_ids: Sequence[int], replica: int) -> Engine

that builds one engine replica alone, on weights of its own that a refit refreshes (a Ray engine
actor), whose trainer's `served_parameters()` are the weights an engine's torch `Decoder` takes
(its names and layout); a bad recipe raises `RecipeError` naming the field. A backend that
refuses some recipes also gives `check(spec)`, which raises that error without building (the
pre-flight checks of `validate` and `run` call it). Its recipe sections
live beside it (`backends/torch/section.py`). Importing this module imports no backend, so
`pipeline/` and `stages/` stay free of torch until a run builds one. To add a backend, add its
name to `BackendName` and its module to `BACKENDS`.

Every backend runs on torch, and torch must come up through `backends.torch.runtime.load`
(which sets how OpenMP's threads wait before libgomp reads it, and opens libtorch without the
GIL): a backend module imports torch at its top, so each is imported only after `load`.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, get_args

from pipeline.contracts.protocols import Engine, Trainer
from pipeline.contracts.sections import BackendName

if TYPE_CHECKING:
    from backends.input import Input

_say = logging.getLogger("pipeline.startup").info  # the run's start-up narration (pipeline/startup.py)

BACKENDS: dict[str, str] = {"torch": "backends.torch.build", "megatron": "backends.megatron.build"}
assert set(BACKENDS) == set(get_args(BackendName)), "a backend named in one place only"


def _module(name: str) -> Any:
    from backends.torch.runtime import load

    load()  # before the backend's own `import torch`, which would bring torch up unprepared
    return importlib.import_module(BACKENDS[name])


def check(spec: Input) -> None:
    """The recipe refusals of the backend `spec.backend` names (its module's `check`, if it has
    one), without building anything: `validate` runs them as `run` does."""
    module = _module(spec.backend)
    if (refuse := getattr(module, "check", None)) is not None:
        refuse(spec)


def build_trainer_alone(spec: Input, *, vocab_size: int) -> Trainer:
    """The trainer alone, of the backend `spec.backend` names: this process's rank of it, where
    its engines run elsewhere (a Ray trainer actor)."""
    module = _module(spec.backend)
    trainer: Trainer = module.build_trainer_alone(spec, vocab_size=vocab_size)
    return trainer


def build_backend(
    spec: Input, *, vocab_size: int, stop_ids: Sequence[int], replica: int = 0
) -> tuple[Engine, Trainer]:
    """The (engine, trainer) pair of the backend `spec.backend` names; `replica`: the engine's
    index where every data-parallel rank holds one (colocated)."""
    module = _module(spec.backend)
    _say("building the model (train.backend %s, model.device %s)", spec.backend, spec.model.device)
    engine, trainer = module.build_backend(spec, vocab_size=vocab_size, stop_ids=stop_ids, replica=replica)
    return engine, trainer


def build_engine_alone(spec: Input, *, vocab_size: int, stop_ids: Sequence[int], replica: int = 0) -> Engine:
    """Engine replica `replica` alone, of the backend `spec.backend` names, on weights of its own
    that a refit refreshes (a Ray engine actor, apart from the trainer)."""
    module = _module(spec.backend)
    engine: Engine = module.build_engine_alone(
        spec, vocab_size=vocab_size, stop_ids=stop_ids, replica=replica
    )
    return engine
