"""Checkpoints: atomic saves, retention and resume.

Layout under `run.dir/checkpoints/`:

    step-000010/            a committed checkpoint
        trainer.pt          model, optimizer, scheduler and trainer RNG (torch.save)
        engine.pt           the engine's sampling RNG (when the engine has one)
        state.msgpack       policy version, step, batch and prompt cursors, counters, Python RNG
        recipe.yaml         the resolved recipe it was written with
        COMMITTED           written last, listing the step and the files: a directory without
                            it is not a checkpoint
    .tmp-step-000012-*      a save in progress (or an orphan of a killed one, removed at start)

Save: write each file into a temporary directory and fsync it, write the marker and fsync it,
fsync the directory, rename it into place, fsync `checkpoints/`. A kill at any point leaves
either the previous committed checkpoints untouched or the new one complete. A state holding
NaN or infinity is never written (`NonFiniteState`), so retention never drops a good
checkpoint for a bad one; a failed save raises `CheckpointError` naming its cause. Resume
verifies what it reads (`stages.resume`). After a save only
the newest `keep_last` committed checkpoints are kept; a failed purge is logged, never fatal.

Resume reads committed checkpoints only. Work admitted after the checkpoint's step (batches
still generating, or generated and not yet trained) is not saved: the prompt cursor points
just past the last trained batch, so those prompts are drawn and generated again after a
resume and every prompt is trained exactly once.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from pipeline.errors import PipelineError, RecipeError
from pipeline.recipe import dump, lookup

log = logging.getLogger("stages.checkpoint")

MARKER = "COMMITTED"
PREFIX = "step-"
TMP_PREFIX = ".tmp-"


class PipelineState(msgspec.Struct, kw_only=True):
    """What the pipeline itself needs to continue exactly where it stopped."""

    step: int
    policy_version: int
    next_batch: int  # batches before it are trained or dropped; its prompts are drawn again
    rollout_counts: dict[str, int]
    reward_counts: dict[str, int]
    empty_batches: int = 0  # batches that had nothing to train on
    # The saved step's metrics record when the save ran inside the step (before its line was
    # written); None for the save of a clean stop, which follows the line.
    last_record: dict[str, Any] | None = None
    python_rng: list[Any]


def _fsync_file(path: Path) -> None:
    with path.open("rb+") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def committed(root: Path) -> list[Path]:
    """Committed checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def clean_orphans(root: Path) -> None:
    """Remove temporary directories left by saves that never finished."""
    if not root.is_dir():
        return
    for path in root.iterdir():
        if path.name.startswith(TMP_PREFIX) or (
            path.name.startswith(PREFIX) and not (path / MARKER).exists()
        ):
            log.warning("removing unfinished checkpoint %s", path)
            shutil.rmtree(path, ignore_errors=True)


Writer = Callable[[Path], None]


class NonFiniteState(Exception):
    """What a writer raises for a state holding NaN or infinity: such a state is never saved."""


class CheckpointError(PipelineError):
    """A checkpoint could not be written (the run stops; the committed ones are intact)."""


class Checkpointer:
    """Writes committed checkpoints; `hook(stage_name)` lets tests kill the process mid-save."""

    def __init__(self, root: Path, *, keep_last: int, hook: Callable[[str], None] | None = None) -> None:
        self.root = root
        self.keep_last = keep_last
        self.hook = hook or (lambda point: None)
        self.last_step = 0  # the step of the newest checkpoint this run wrote or resumed from

    def check_writable(self) -> None:
        """Fail at the start, not at the first save, when checkpoints cannot be written."""
        probe = self.root / f"{TMP_PREFIX}probe-{os.getpid()}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe.write_text("")
            probe.unlink()
        except OSError as error:
            raise CheckpointError(
                f"checkpoint: cannot write to {self.root}: {error.strerror or error}; "
                "make it writable or choose another run.dir"
            ) from None

    def save(self, step: int, files: dict[str, Writer], recipe: msgspec.Struct) -> Path:
        """Write and commit step `step`'s checkpoint; a failure (a full disk, a state that is not
        finite) raises `CheckpointError`, leaving the committed checkpoints as they were."""
        final = self.root / f"{PREFIX}{step:06d}"
        tmp = self.root / f"{TMP_PREFIX}{PREFIX}{step:06d}-{os.getpid()}"
        try:
            self._write(tmp, files, recipe, step)
        except (OSError, NonFiniteState) as error:
            shutil.rmtree(tmp, ignore_errors=True)
            kept = committed(self.root)
            raise CheckpointError(
                f"checkpoint: saving step {step} to {final} failed: {error}; the last good checkpoint "
                f"is {kept[-1] if kept else 'none'}"
            ) from None
        self.hook("before_rename")
        if final.exists():  # a re-save of the same step (a stop right after a scheduled save)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        self.hook("after_rename")
        self._purge()
        self.last_step = step
        return final

    def _write(self, tmp: Path, files: dict[str, Writer], recipe: msgspec.Struct, step: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        self.hook("before_files")
        for name, write in files.items():
            write(tmp / name)
            _fsync_file(tmp / name)
            self.hook(f"after:{name}")
        (tmp / "recipe.yaml").write_text(dump(recipe))
        _fsync_file(tmp / "recipe.yaml")
        self.hook("before_marker")
        # The marker lists the files, so a resume can tell a complete checkpoint from a damaged one.
        (tmp / MARKER).write_text("".join(f"{line}\n" for line in (step, *files, "recipe.yaml")))
        _fsync_file(tmp / MARKER)
        _fsync_dir(tmp)

    def _purge(self) -> None:
        for old in committed(self.root)[: -self.keep_last]:
            try:
                shutil.rmtree(old)
            except OSError as error:
                log.warning("could not remove old checkpoint %s: %s", old, error)


# Recipe fields a checkpoint cannot survive changing, or that a resume would silently ignore:
# the seed drew the prompt order, and the optimizer's saved state restores its lr, weight
# decay and betas.
BINDING_FIELDS = (
    "model",
    "prompts.prompts_per_step",
    "prompts.source",
    "rollout.samples_per_prompt",
    "run.seed",
    "train.lr",
    "train.weight_decay",
    "train.beta1",
    "train.beta2",
)


def with_defaults(saved: dict[str, Any], recipe_type: type) -> dict[str, Any]:
    """A checkpoint's recipe with the fields it predates filled in with their defaults, so a
    field added since (with a default) is not a difference; as written if it no longer decodes
    (a field since removed), so that the comparison names what changed."""
    try:
        return msgspec.to_builtins(msgspec.convert(saved, recipe_type))
    except msgspec.ValidationError:
        return saved


def check_compatible(saved: dict[str, Any], current: dict[str, Any], checkpoint: Path) -> None:
    for field in BINDING_FIELDS:
        old, new = lookup(saved, field), lookup(current, field)
        if field == "model":
            old = {k: v for k, v in (old or {}).items() if k not in ("threads", "device")}
            new = {k: v for k, v in (new or {}).items() if k not in ("threads", "device")}
        if old != new:
            raise RecipeError(
                f"{field}: differs from checkpoint {checkpoint} (was {old!r}, now {new!r}); "
                "resume with the recipe the checkpoint was written with, or start a new run.dir"
            )


def check_steps_left(steps: int, state: PipelineState, checkpoint: Path) -> None:
    """A resume must have steps to train: rerunning a finished run silently did nothing."""
    if steps <= state.step:
        raise RecipeError(
            f"run.steps: {steps}, but the run in {checkpoint.parent.parent} has trained {state.step} "
            f"steps (checkpoint {checkpoint.name}); set run.steps above {state.step} to train more, "
            "or choose another run.dir"
        )


def python_rng_state() -> list[Any]:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def set_python_rng_state(state: list[Any]) -> None:
    random.setstate((state[0], tuple(state[1]), state[2]))


def describe(checkpoint: Path, against: dict[str, Any] | None = None) -> str:
    """What `python -m pipeline inspect` prints: step, version, files, recipe differences."""
    import yaml

    if not (checkpoint / MARKER).is_file():
        raise RecipeError(f"{checkpoint}: not a committed checkpoint (no {MARKER} file)")
    state = msgspec.msgpack.decode((checkpoint / "state.msgpack").read_bytes(), type=PipelineState)
    lines = [
        f"checkpoint {checkpoint}",
        f"  step {state.step}, policy_version {state.policy_version}, next batch {state.next_batch}",
        "  files:",
    ]
    for path in sorted(checkpoint.iterdir()):
        lines.append(f"    {path.name:<16} {path.stat().st_size:>12,} bytes")
    counters = {f"rollout/{k}": v for k, v in state.rollout_counts.items()}
    counters |= {f"reward/{k}": v for k, v in state.reward_counts.items()}
    if counters:
        lines.append("  counters: " + ", ".join(f"{k}={v}" for k, v in sorted(counters.items())))
    if against is not None:
        saved = yaml.safe_load((checkpoint / "recipe.yaml").read_text())
        diffs = list(_diff(saved, against, ""))
        lines.append(
            "  recipe: same as given" if not diffs else "  recipe differences (checkpoint -> given):"
        )
        lines.extend(f"    {field}: {old!r} -> {new!r}" for field, old, new in diffs)
    return "\n".join(lines)


def _diff(old: Any, new: Any, prefix: str) -> Any:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            yield from _diff(old.get(key), new.get(key), f"{prefix}.{key}" if prefix else key)
    elif old != new:
        yield prefix, old, new
