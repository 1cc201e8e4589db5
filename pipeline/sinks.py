"""Where metrics go besides `metrics.jsonl`: wandb and TensorBoard, as the recipe chooses.

A sink has `log(record, step)` and `close()`. Sinks are optional packages: enabling one that
is not installed is a recipe error naming the field and the install command.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Protocol

from pipeline.errors import PipelineError, RecipeError
from pipeline.recipe import TensorBoardSection, WandbSection


class Sink(Protocol):
    def log(self, record: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


class WandbSink:
    """One wandb run per run directory: a resumed run continues the same wandb run.

    The mode is passed only when the recipe sets it, so `WANDB_MODE` keeps working.
    """

    def __init__(self, section: WandbSection, run_dir: Path, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise RecipeError("wandb.enabled: wandb is not installed (pip install wandb)") from None
        id_file = run_dir / "wandb-id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id + "\n")
        options: dict[str, Any] = {
            "project": section.project,
            "name": section.name or run_dir.resolve().name,
            "tags": list(section.tags),
            "dir": str(run_dir),
            "config": config,
            "id": run_id,
            "resume": "allow",
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


class TensorBoardSink:
    """Scalars in `run.dir/tensorboard`, one tag per metric key."""

    def __init__(self, run_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise RecipeError(
                "tensorboard.enabled: the tensorboard package is not installed (pip install tensorboard)"
            ) from None
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), flush_secs=10)

    def log(self, record: dict[str, Any], step: int) -> None:
        for key, value in record.items():
            if isinstance(value, int | float) and not isinstance(value, bool) and key != "step":
                self.writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


def open_sinks(
    wandb: WandbSection, tensorboard: TensorBoardSection, run_dir: Path, config: dict[str, Any]
) -> list[Sink]:
    sinks: list[Sink] = []
    if wandb.enabled:
        sinks.append(WandbSink(wandb, run_dir, config))
    if tensorboard.enabled:
        sinks.append(TensorBoardSink(run_dir))
    return sinks
