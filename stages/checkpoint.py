"""Checkpoints and resume: atomic saves, retention, verified resume, `inspect`.

Layout under `run.dir/checkpoints/` (the pipeline's own file names are the constants below; each
backend part names its own, e.g. the torch backend's `trainer.pt` and `engine.pt`):

    step-000010/            a committed checkpoint
        <backend files>     what each `Checkpointable` part (trainer, engine) saved
        state.msgpack       policy version, step, batch and prompt cursors, counters, Python RNG
        recipe.yaml         the resolved recipe it was written with
        COMMITTED           written last, listing the step and every file with its size and
                            checksum (`stages.checkpoint_marker`): a directory without it is
                            not a checkpoint
    .tmp-step-000012-*      a save in progress (or an orphan of a killed one, removed at start)
    damaged-step-000009/    a committed checkpoint that did not load, set aside by a resume
                            (`.2`, `.3`, ... when the same step was set aside before)
    abandoned-step-000011/  newer than the checkpoint a resume by path continued from

Save, in two phases (`stages.checkpoint_writer` runs the second in the background): the
snapshot, inside the step, takes each part's state (`Snapshotting` parts copy it to memory,
others write their files now); the write has the snapshots write their files into a temporary
directory, then the pipeline's; each is fsynced, the marker written and fsynced, the directory
renamed into place, `checkpoints/` fsynced. A kill at any point leaves either the previous
committed checkpoints untouched or the new one complete. A part whose state holds NaN or
infinity refuses to write it (`NonFiniteState`), so retention never drops a good checkpoint for
a bad one; a failed save raises `CheckpointError` naming its cause. After a save only the newest
`keep_last` committed checkpoints are kept; a failed purge is logged, never fatal.

Resume reads committed checkpoints only. A checkpoint is usable when every file its marker lists
(for markers that list none: `state.msgpack` and `recipe.yaml`) is present with the size and
checksum listed and reads, and every part loads its own (`DamagedState` otherwise). With
`checkpoint.resume: auto` a damaged newest checkpoint is reported in one line and the previous
one is tried; the damaged ones are renamed `damaged-step-NNNNNN` once the run holds the run
directory, so neither a later resume nor retention counts them. A checkpoint named by path must
itself be usable; the committed ones of the run directory at or past its step (another branch of
the run) are renamed `abandoned-*`. Work admitted after the checkpoint's step is not saved: the
prompt cursor points just past the last trained batch, so those prompts are drawn and generated
again and every prompt is trained exactly once.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import yaml

from pipeline.contracts.errors import DamagedState, NonFiniteState, PipelineError, RecipeError
from pipeline.contracts.protocols import Checkpointable, Snapshot, Snapshotting
from pipeline.contracts.text import NotText, read_text
from pipeline.metrics import EVAL_FILE, STEPS_FILE, finite, read
from pipeline.recipe import dump, lookup
from stages.checkpoint_marker import MARKER, Listed, checksum, marker_text, read_marker, verify
from stages.run_dir import LOCK_FILE

log = logging.getLogger("stages.checkpoint")

STATE_FILE = "state.msgpack"
RECIPE_FILE = "recipe.yaml"
PREFIX = "step-"
TMP_PREFIX = ".tmp-"
DAMAGED_PREFIX = "damaged-"
ABANDONED_PREFIX = "abandoned-"


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


class CheckpointError(PipelineError):
    """A checkpoint could not be written (the run stops; the committed ones are intact)."""


def committed(root: Path) -> list[Path]:
    """Committed checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / MARKER).is_file()]
    return sorted(found, key=_step)


def newest(root: Path) -> Path | None:
    found = committed(root)
    return found[-1] if found else None


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


class Checkpointer:
    """Writes committed checkpoints, in two phases: `snapshot` (inside the train step) copies
    the state to be saved, `write` (later, on another thread, while training goes on) writes,
    verifies and commits it; `save` does both at once.

    `hook(point)` lets tests kill the process or fail the disk at each moment of a save:
    `before_snapshot`; then in `write`: `before_files`, `after:<file>` for each file,
    `before_marker`, `before_rename`, `after_rename`, `purge:<checkpoint>` before each removal
    by retention.
    """

    def __init__(self, root: Path, *, keep_last: int, hook: Callable[[str], None] | None = None) -> None:
        self.root = root
        self.keep_last = keep_last
        self.hook = hook or (lambda point: None)
        # The step of the newest checkpoint this run snapshotted (its write committed, in
        # flight, or failed and stopping the run) or resumed from.
        self.last_step = 0

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

    def save(
        self, step: int, parts: Sequence[Checkpointable], state: PipelineState, recipe: msgspec.Struct
    ) -> Path:
        """Snapshot and write step `step`'s checkpoint at once (on a worker thread)."""
        return self.write(self.snapshot(step, parts, state, recipe))

    def snapshot(
        self, step: int, parts: Sequence[Checkpointable], state: PipelineState, recipe: msgspec.Struct
    ) -> Pending:
        """Take step `step`'s state (on a worker thread, inside the step): each part's
        `snapshot` (a copy to host memory), or, for a part without one, its files written now.
        A failure raises `CheckpointError`, leaving the committed checkpoints as they were."""
        self.hook("before_snapshot")
        final = self.root / f"{PREFIX}{step:06d}"
        tmp = self.root / f"{TMP_PREFIX}{PREFIX}{step:06d}-{os.getpid()}"
        snapshots: list[Snapshot] = []
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            for part in parts:
                if isinstance(part, Snapshotting):
                    snapshots.append(part.snapshot(tmp))
                else:
                    part.save(tmp)
        except (OSError, NonFiniteState) as error:
            raise self._failed(step, final, tmp, error) from None
        self.last_step = step
        return Pending(step=step, tmp=tmp, final=final, snapshots=snapshots, state=state, recipe=recipe)

    def write(self, pending: Pending) -> Path:
        """Write `pending`'s files, fsync them, list them with their checksums in the marker,
        rename the directory into place, then apply retention. A failure (a full disk, a state
        that is not finite) raises `CheckpointError`, with nothing of it committed and the
        committed checkpoints as they were."""
        try:
            self._write(pending)
        except (OSError, NonFiniteState) as error:
            raise self._failed(pending.step, pending.final, pending.tmp, error) from None
        except BaseException:  # a lost backend, a bug: raised as it is, nothing of it left
            shutil.rmtree(pending.tmp, ignore_errors=True)
            raise
        self.hook("before_rename")
        if pending.final.exists():  # a re-save of the same step
            shutil.rmtree(pending.final)
        os.rename(pending.tmp, pending.final)
        _fsync_dir(self.root)
        self.hook("after_rename")
        self._purge()
        return pending.final

    def _failed(self, step: int, final: Path, tmp: Path, error: BaseException) -> CheckpointError:
        shutil.rmtree(tmp, ignore_errors=True)
        kept = committed(self.root)
        return CheckpointError(
            f"checkpoint: saving step {step} to {final} failed: {error}; the last good checkpoint "
            f"is {kept[-1] if kept else 'none'}"
        )

    def _write(self, pending: Pending) -> None:
        tmp = pending.tmp
        self.hook("before_files")
        listed: list[Listed] = []  # each file written, fsynced, with its checksum
        seconds = {"files": 0.0, "flush": 0.0}  # for the debug line below

        def wrote_since() -> None:
            start = time.perf_counter()
            for name in sorted(set(_files(tmp)) - {f.name for f in listed}):
                listed.append(flushed(tmp, name))
                self.hook(f"after:{name}")
            seconds["flush"] += time.perf_counter() - start

        wrote_since()  # what parts without a snapshot wrote in the step
        for snapshot in pending.snapshots:
            start = time.perf_counter()
            snapshot.write()
            seconds["files"] += time.perf_counter() - start
            wrote_since()
        (tmp / STATE_FILE).write_bytes(msgspec.msgpack.encode(pending.state))
        wrote_since()
        (tmp / RECIPE_FILE).write_text(dump(pending.recipe))
        wrote_since()
        log.debug(
            "checkpoint step %d: %.2f GB written in %.2f s, fsynced and checksummed in %.2f s",
            pending.step,
            sum(f.size or 0 for f in listed) / 1e9,
            seconds["files"],
            seconds["flush"],
        )
        self.hook("before_marker")
        (tmp / MARKER).write_text(marker_text(pending.step, listed))
        _fsync_file(tmp / MARKER)
        for directory in sorted({(tmp / f.name).parent for f in listed}, reverse=True):
            _fsync_dir(directory)

    def _purge(self) -> None:
        for old in committed(self.root)[: -self.keep_last]:
            self.hook(f"purge:{old.name}")
            try:
                shutil.rmtree(old)
            except OSError as error:
                log.warning("could not remove old checkpoint %s: %s", old, error)


class Pending(msgspec.Struct, kw_only=True):
    """A snapshotted checkpoint, not yet written: its parts' snapshots and the pipeline's state."""

    step: int
    tmp: Path
    final: Path
    snapshots: list[Snapshot]
    state: PipelineState
    recipe: msgspec.Struct


def _files(directory: Path) -> list[str]:
    """The files under `directory` (a part may write a folder of its own), as relative paths."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


def flushed(directory: Path, name: str) -> Listed:
    """`name` (under `directory`) fsynced, with its size and checksum for the marker (the
    checksum is read from the page cache while the fsync waits for the disk: a large state's
    write-back and its checksum take seconds each)."""
    path = directory / name
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsync") as pool:
        synced = pool.submit(_fsync_file, path)
        listed = Listed(name, path.stat().st_size, checksum(path))
        synced.result()
    return listed


def _fsync_file(path: Path) -> None:
    with path.open("rb+") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- resume -----------------------------------------------------------------------------------


class Saved(msgspec.Struct, frozen=True, kw_only=True):
    """A committed checkpoint's own files, read and decoded."""

    path: Path
    state: PipelineState
    recipe: dict[str, Any]


def read_saved(path: Path) -> Saved:
    """`path`'s marker-listed files present and as committed (size and checksum), its state and
    recipe decoded; `DamagedState` naming the file if not."""
    try:
        _, listed = read_marker(path)
        verify(path, listed or [Listed(STATE_FILE), Listed(RECIPE_FILE)])
        state = msgspec.msgpack.decode((path / STATE_FILE).read_bytes(), type=PipelineState)
        recipe = yaml.safe_load(read_text(path / RECIPE_FILE))
    except NotText as error:
        raise DamagedState(str(error)) from None
    except (OSError, msgspec.DecodeError, yaml.YAMLError) as error:
        raise DamagedState(f"{type(error).__name__}: {error}") from None
    if not isinstance(recipe, dict):
        raise DamagedState(f"{RECIPE_FILE} is not a recipe")
    return Saved(path=path, state=state, recipe=recipe)


class Resumed(msgspec.Struct, frozen=True, kw_only=True):
    saved: Saved
    load_s: float  # reading, verifying and loading it
    damaged: tuple[Path, ...]  # newer committed checkpoints that did not load

    @property
    def state(self) -> PipelineState:
        return self.saved.state


class Resume:
    """The committed checkpoints a run may resume from, tried newest first.

    `open_resume` builds it and finds the newest checkpoint whose own files read, checked
    against the recipe by `check` (before the backend is built: a refused resume costs no model
    load); `load(parts)` then loads every part from it, moving on to the one before while a
    part finds its files damaged. `newest` is the newest committed checkpoint when it looked,
    damaged or not (a run that finds another one after taking the lock was raced).
    """

    def __init__(self, candidates: list[Path], *, named: bool, check: Callable[[Saved], None]) -> None:
        self._candidates = candidates
        self.named = named
        self.check = check
        self.newest = None if named or not candidates else candidates[0]
        self.damaged: list[Path] = []
        self.read_s = 0.0
        self.current = self._next()

    def _next(self) -> Saved | None:
        start = time.perf_counter()
        try:
            while self._candidates:
                path = self._candidates.pop(0)
                try:
                    found = read_saved(path)
                except DamagedState as error:
                    self._damaged(path, error)
                    continue
                self.check(found)
                return found
            if self.damaged:
                raise PipelineError(
                    f"no usable checkpoint in {self.damaged[0].parent}: every committed one is damaged "
                    "(see the warnings above); move checkpoints/ away to start afresh"
                )
            return None
        finally:
            self.read_s += time.perf_counter() - start

    def _damaged(self, path: Path, error: DamagedState) -> None:
        if self.named:
            raise RecipeError(f"checkpoint.resume: {path} cannot be used: {error}")
        self.damaged.append(path)
        log.warning("checkpoint %s is damaged (%s); trying the one before it", path, error)

    def load(self, parts: Sequence[Checkpointable]) -> Resumed | None:
        """Load `parts` from the newest usable checkpoint (on a worker thread); None: none to
        resume from, start fresh."""
        start = time.perf_counter()
        while self.current is not None:
            try:
                for part in parts:
                    part.load(self.current.path)
            except DamagedState as error:
                self._damaged(self.current.path, error)
                self.current = self._next()
                continue
            load_s = self.read_s + time.perf_counter() - start
            return Resumed(saved=self.current, load_s=load_s, damaged=tuple(self.damaged))
        return None


def open_resume(run_dir: Path, recipe: Any) -> Resume | None:
    """What `checkpoint.resume` asks for: None to start fresh (`never`, or nothing committed)."""
    resume = recipe.checkpoint.resume
    if resume == "never":
        if run_dir.exists() and any(p.name != LOCK_FILE for p in run_dir.iterdir()):
            raise RecipeError(
                f"checkpoint.resume: run.dir {run_dir} is not empty and resume is 'never'; "
                "choose another run.dir or set checkpoint.resume: auto"
            )
        return None
    if resume == "auto":
        candidates = list(reversed(committed(run_dir / "checkpoints")))
        if not candidates:
            return None
    else:
        path = Path(resume)
        if not (path / MARKER).is_file():
            raise RecipeError(f"checkpoint.resume: {path} is not a committed checkpoint (no {MARKER} file)")
        candidates = [path]
    return Resume(candidates, named=resume != "auto", check=lambda saved: check_resume(recipe, saved))


def set_aside(damaged: Sequence[Path]) -> None:
    """Rename damaged checkpoints `damaged-step-NNNNNN` (a free name: the same step may have been
    damaged before), so neither a later resume nor retention counts them."""
    for path in damaged:
        os.replace(path, _free_name(path, DAMAGED_PREFIX))


def abandon_newer(root: Path, resumed: Resumed) -> None:
    """Set aside the checkpoints under `root` of a branch the resume abandoned: committed ones at
    or past the resumed step, other than the resumed one (a resume from an older checkpoint by
    path). Renamed `abandoned-step-NNNNNN`, so `auto` never continues from them, and said in
    one line."""
    step, source = resumed.state.step, resumed.saved.path.resolve()
    newer = [p for p in committed(root) if _step(p) >= step and p.resolve() != source]
    if not newer:
        return
    moved = [_free_name(path, ABANDONED_PREFIX) for path in newer]
    for path, target in zip(newer, moved, strict=True):
        os.replace(path, target)
    log.warning(
        "resumed from %s (step %d): set aside the checkpoints of the abandoned branch, which "
        "checkpoint.resume: auto would have continued from: %s",
        resumed.saved.path,
        step,
        ", ".join(f"{path.name} -> {target.name}" for path, target in zip(newer, moved, strict=True)),
    )


def _step(path: Path) -> int:
    return int(path.name[len(PREFIX) :])


def _free_name(path: Path, prefix: str) -> Path:
    """`prefix + path.name` beside `path`, or with `.2`, `.3`, ... when taken."""
    target = path.with_name(prefix + path.name)
    number = 1
    while target.exists():
        number += 1
        target = path.with_name(f"{prefix}{path.name}.{number}")
    return target


def restore_metrics(run_dir: Path, state: PipelineState) -> set[int]:
    """Make the metrics files end at the checkpoint's step; the steps evaluated (`eval.jsonl`).

    Drops records of later steps (logged by the interrupted run) and a line cut short by a
    kill; if the run was killed between the checkpoint and its step's line, writes that line
    back from the checkpoint, marked `metrics/recovered` (without the save's and the wake's
    timings).
    """
    evaluated: set[int] = set()
    for name, recover in ((STEPS_FILE, True), (EVAL_FILE, False)):
        path = run_dir / name
        records = read(path) if path.exists() else []  # read skips a line a kill cut short
        keep = [r for r in records if r.get("step", 0) <= state.step]
        if recover and state.last_record is not None and not any(r.get("step") == state.step for r in keep):
            keep.append(finite({**state.last_record, "metrics/recovered": 1}))
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        tmp.replace(path)
        if not recover:
            evaluated = {r["step"] for r in keep if "step" in r}
    return evaluated


# Recipe fields a checkpoint cannot survive changing, or that a resume would silently ignore:
# the seed drew the prompt order, and the optimizer's saved state restores its lr, weight
# decay and betas.
BINDING_FIELDS = (
    "model",
    "prompts.prompts_per_step",
    "prompts.source",
    "rollout.samples_per_prompt",
    "run.seed",
    "train.backend",
    "train.lr",
    "train.weight_decay",
    "train.beta1",
    "train.beta2",
    # Each data-parallel rank's checkpoint file holds its own shard of the optimizer state.
    "train.data_parallel",
)


def check_resume(recipe: Any, saved: Saved) -> None:
    """`RecipeError` when `recipe` cannot continue the run `saved` checkpointed."""
    check_compatible(with_defaults(saved.recipe, type(recipe)), msgspec.to_builtins(recipe), saved.path)
    check_steps_left(recipe.run.steps, saved.state, saved.path)


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


# -- inspect ----------------------------------------------------------------------------------


def describe(checkpoint: Path, against: dict[str, Any] | None = None) -> str:
    """What `python -m pipeline inspect` prints: step, version, files, recipe differences."""
    if not (checkpoint / MARKER).is_file():
        raise RecipeError(f"{checkpoint}: not a committed checkpoint (no {MARKER} file)")
    try:
        saved = read_saved(checkpoint)
    except DamagedState as error:
        raise RecipeError(f"{checkpoint}: a damaged checkpoint: {error}") from None
    state = saved.state
    lines = [
        f"checkpoint {checkpoint}",
        f"  step {state.step}, policy_version {state.policy_version}, next batch {state.next_batch}",
        "  files:",
    ]
    for name in _files(checkpoint):
        lines.append(f"    {name:<16} {(checkpoint / name).stat().st_size:>12,} bytes")
    counters = {f"rollout/{k}": v for k, v in state.rollout_counts.items()}
    counters |= {f"reward/{k}": v for k, v in state.reward_counts.items()}
    if counters:
        lines.append("  counters: " + ", ".join(f"{k}={v}" for k, v in sorted(counters.items())))
    if against is not None:
        diffs = list(_diff(saved.recipe, against, ""))
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
