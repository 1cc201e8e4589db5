"""Where metrics go besides `metrics.jsonl`: wandb and TensorBoard, as the recipe chooses.

A sink has `log(record, step)` and `close()`. Sinks are optional packages: enabling one that
is not installed is a recipe error naming the field and the install command.

On resume from a checkpoint at step N, what the interrupted run logged after N is discarded
from `metrics.jsonl`; the sinks follow: wandb continues in a new run of the same group (a wandb
run cannot rewind its steps), TensorBoard marks step N+1 so that readers drop the stale events.
"""

from __future__ import annotations

import importlib.util
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

from pipeline.contracts.errors import PipelineError, RecipeError
from pipeline.contracts.sections import TensorBoardSection, WandbSection


class Sink(Protocol):
    def log(self, record: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


class WandbSink:
    """One wandb group per run directory; each start or resume is a run in it.

    The mode is passed only when the recipe sets it, so `WANDB_MODE` keeps working.
    """

    def __init__(
        self, section: WandbSection, run_dir: Path, config: dict[str, Any], resume_step: int | None
    ) -> None:
        try:
            import wandb
        except ImportError:
            raise RecipeError(NO_WANDB) from None
        name = section.name or run_dir.resolve().name
        options: dict[str, Any] = {
            "project": section.project,
            "group": name,
            "name": name if resume_step is None else f"{name}-from-{resume_step}",
            "tags": [*section.tags, *(["resumed"] if resume_step is not None else [])],
            "dir": str(run_dir),
            "config": {**config, "resumed_from_step": resume_step},
            "id": uuid.uuid4().hex[:8],
        }
        if section.mode is not None:
            options["mode"] = section.mode
        try:
            self.run = wandb.init(**options)
        except Exception as error:  # no login, no network in online mode, a bad project name
            raise PipelineError(
                f"wandb: could not start a run ({type(error).__name__}: {error}); "
                "set WANDB_MODE=offline or wandb.mode: offline to log locally"
            ) from None

    def log(self, record: dict[str, Any], step: int) -> None:
        self.run.log(record, step=step)

    def close(self) -> None:
        self.run.finish()


NO_WANDB = "wandb.enabled: wandb is not installed (pip install wandb)"
NO_TENSORBOARD = "tensorboard.enabled: the tensorboard package is not installed (pip install tensorboard)"


def check_installed(*, wandb: bool, tensorboard: bool) -> None:
    """The packages the enabled sinks import, found (`RecipeError` as the sink would raise it),
    so `validate` says so and a run says so before it loads anything."""
    if wandb and importlib.util.find_spec("wandb") is None:
        raise RecipeError(NO_WANDB)
    if tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise RecipeError(NO_TENSORBOARD)


class TensorBoardSink:
    """Scalars in `run.dir/tensorboard`, one tag per metric key (the tensorboard package's own
    event writer: no torch here)."""

    def __init__(self, run_dir: Path, resume_step: int | None) -> None:
        try:
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise RecipeError(NO_TENSORBOARD) from None
        self._event, self._summary = Event, Summary
        self.writer = EventFileWriter(str(run_dir / "tensorboard"), flush_secs=10)
        if resume_step is not None:  # readers drop events at later steps from earlier files
            self.writer.add_event(
                Event(
                    step=resume_step + 1,
                    wall_time=time.time(),
                    session_log=SessionLog(status=SessionLog.START),
                )
            )

    def log(self, record: dict[str, Any], step: int) -> None:
        values = [
            self._summary.Value(tag=key, simple_value=float(value))
            for key, value in record.items()
            if isinstance(value, int | float) and not isinstance(value, bool) and key != "step"
        ]
        self.writer.add_event(
            self._event(step=step, wall_time=time.time(), summary=self._summary(value=values))
        )

    def close(self) -> None:
        self.writer.close()


def open_sinks(
    wandb: WandbSection,
    tensorboard: TensorBoardSection,
    run_dir: Path,
    config: dict[str, Any],
    *,
    resume_step: int | None = None,
) -> list[Sink]:
    sinks: list[Sink] = []
    if wandb.enabled:
        sinks.append(WandbSink(wandb, run_dir, config, resume_step))
    if tensorboard.enabled:
        sinks.append(TensorBoardSink(run_dir, resume_step))
    return sinks
