"""Resume: the newest checkpoint that loads, verified before the run trusts it.

A committed checkpoint is usable when every file its `COMMITTED` marker lists (and, for
markers that list none, `trainer.pt`, `state.msgpack` and `recipe.yaml`) is present and
reads, and every floating-point tensor in it is finite. With `checkpoint.resume: auto` a
damaged newest checkpoint is reported in one line and the previous committed one is tried;
the damaged ones are renamed `damaged-step-NNNNNN` (by `set_aside`, once the run holds the
run directory), so neither a later resume nor retention counts them. A checkpoint named by
path must itself be usable. The loaded states are handed to the backend as they are: nothing
is read twice.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec
import yaml

from pipeline.errors import PipelineError, RecipeError
from stages.checkpoint import MARKER, PipelineState, committed
from stages.run_dir import LOCK_FILE

log = logging.getLogger("stages.resume")

DAMAGED_PREFIX = "damaged-"
REQUIRED = ("trainer.pt", "state.msgpack", "recipe.yaml")


class Resumed(msgspec.Struct, kw_only=True, frozen=True):
    path: Path
    state: PipelineState
    recipe: dict[str, Any]
    # The trainer's and the engine's states ("trainer.pt", "engine.pt"), as torch.load returned
    # them; taken out (popped) when loaded into the backend, so they are not held for the run.
    states: dict[str, Any]
    load_s: float = 0.0  # reading and verifying it (torch's import not included)
    damaged: tuple[Path, ...] = ()  # newer committed checkpoints that did not load


class DamagedCheckpoint(Exception):
    """A committed checkpoint whose files are missing, unreadable or not finite."""


def open_resume(run_dir: Path, resume: str) -> Resumed | None:
    """The checkpoint to resume from, loaded and verified; None to start fresh."""
    if resume == "never":
        if run_dir.exists() and any(p.name != LOCK_FILE for p in run_dir.iterdir()):
            raise RecipeError(
                f"checkpoint.resume: run.dir {run_dir} is not empty and resume is 'never'; "
                "choose another run.dir or set checkpoint.resume: auto"
            )
        return None
    if resume != "auto":
        path = Path(resume)
        if not (path / MARKER).is_file():
            raise RecipeError(f"checkpoint.resume: {path} is not a committed checkpoint (no {MARKER} file)")
        try:
            return _load(path)
        except DamagedCheckpoint as error:
            raise RecipeError(f"checkpoint.resume: {path} cannot be used: {error}") from None
    damaged: list[Path] = []
    for path in reversed(committed(run_dir / "checkpoints")):
        try:
            found = _load(path)
        except DamagedCheckpoint as error:
            damaged.append(path)
            log.warning("checkpoint %s is damaged (%s); trying the one before it", path, error)
            continue
        return msgspec.structs.replace(found, damaged=tuple(damaged))
    if damaged:
        raise PipelineError(
            f"no usable checkpoint in {run_dir / 'checkpoints'}: every committed one is damaged "
            "(see the warnings above); move checkpoints/ away to start afresh"
        )
    return None


def set_aside(damaged: tuple[Path, ...]) -> None:
    for path in damaged:
        os.replace(path, path.with_name(DAMAGED_PREFIX + path.name))


def _load(path: Path) -> Resumed:
    import torch

    start = time.perf_counter()
    try:
        listed = (path / MARKER).read_text().split()[1:]
        for name in listed or REQUIRED:
            if not (path / name).is_file():
                raise DamagedCheckpoint(f"{name} is missing")
        state = msgspec.msgpack.decode((path / "state.msgpack").read_bytes(), type=PipelineState)
        recipe = yaml.safe_load((path / "recipe.yaml").read_text())
    except (OSError, msgspec.DecodeError, yaml.YAMLError) as error:
        raise DamagedCheckpoint(f"{type(error).__name__}: {error}") from None
    if not isinstance(recipe, dict):
        raise DamagedCheckpoint("recipe.yaml is not a recipe")
    loaded = {}
    for name in ("trainer.pt", "engine.pt"):
        if not (path / name).is_file():
            continue
        try:
            loaded[name] = torch.load(path / name, weights_only=False)
        except Exception as error:  # torch reports a torn or garbled file many ways
            raise DamagedCheckpoint(f"{name} does not load: {type(error).__name__}: {error}") from None
        where = nonfinite(loaded[name])
        if where is not None:
            raise DamagedCheckpoint(f"{name} holds non-finite values at {where}")
    return Resumed(
        path=path,
        state=state,
        recipe=recipe,
        states=loaded,
        load_s=time.perf_counter() - start,
    )


def nonfinite(value: Any, where: str = "") -> str | None:
    """The path to the first NaN or infinity in a nested state (tensors, floats), or None."""
    import torch

    if isinstance(value, torch.Tensor):
        # A NaN or infinity anywhere makes the sum non-finite; the sum is one pass without a
        # mask (12x faster than isfinite().all() on CPU), and a finite tensor whose sum
        # overflows is caught by the full check.
        if not value.is_floating_point() or bool(torch.isfinite(value.sum())):
            return None
        return None if bool(torch.isfinite(value).all()) else where or "the tensor"
    if isinstance(value, float):
        return None if math.isfinite(value) else where
    items: Iterable[tuple[Any, Any]]
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = nonfinite(item, f"{where}.{key}" if where else str(key))
        if found is not None:
            return found
    return None
