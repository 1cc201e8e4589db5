"""The run directory's contract: one run at a time, and no run's files lost to another's.

- `RunDirLock` holds an exclusive `fcntl.flock` on `run.dir/.lock` for the whole run; the
  file names the holder (pid, host, start time). A second run on the directory is refused
  (`RecipeError`, exit 2) naming the holder: before it loads anything (`check_free`), and
  again when it takes the lock (`acquire`), once it has loaded. The kernel drops the lock
  when its process dies, so a lock left by a killed run never blocks the next one.
- `keep_earlier_runs` is called once the lock is held, before the run writes anything: the
  previous start's `trace.json` and `recipe.yaml` become `trace.N.json` and `recipe.N.yaml`
  (N = 1, 2, ... in the order the starts were made). A fresh start (no checkpoint to resume)
  over a run's `metrics.jsonl` / `eval.jsonl` moves them to `metrics.N.jsonl` / `eval.N.jsonl`
  too, so a new run never appends to an earlier one's history. A resume keeps them: they are
  rewound to the checkpoint's step (`stages.program`).
- `record_stop` notes in `run.dir/stopped.json` the step where a clean stop ended the run's
  latest start, so that `check` skips the gates on steps it never reached, as the run's own
  verdict did (`stopped_at`); each start removes the note, so a start that finishes, or one
  that is killed, leaves none (its unreached gates fail).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import TextIO

from pipeline.contracts.errors import RecipeError
from pipeline.metrics import EVAL_FILE, STEPS_FILE

log = logging.getLogger("stages.run_dir")

LOCK_FILE = ".lock"
TRACE_FILE = "trace.json"
RECIPE_FILE = "recipe.yaml"
STOP_FILE = "stopped.json"
# What each start leaves: always archived, or only when the next start is fresh.
_PER_START = (TRACE_FILE, RECIPE_FILE)
_PER_HISTORY = (STEPS_FILE, EVAL_FILE)


class RunDirLock:
    """An exclusive lock on a run directory, held from `acquire()` to `release()`."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self._file: TextIO | None = None

    def check_free(self) -> None:
        """Refuse now, before loading anything, if another run holds the lock (writes nothing)."""
        if not self.path.is_file():
            return
        with self.path.open() as handle:
            self._lock(handle)  # closing the file drops the probe's lock

    def acquire(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle = self.path.open("a+")
        except OSError as error:
            raise RecipeError(
                f"run.dir: cannot create {self.path}: {error.strerror or error}; choose a writable run.dir"
            ) from None
        self._lock(handle)
        handle.seek(0)
        handle.truncate()
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} (started {started})\n")
        handle.flush()
        self._file = handle

    def _lock(self, handle: TextIO) -> None:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise RecipeError(
                f"run.dir: {self.path.parent} is in use by {holder}; wait for that run to end "
                "or choose another run.dir"
            ) from None

    def release(self) -> None:
        """Closing the file drops the lock. The file stays: removing it would let two runs
        lock two different files of the same name."""
        if self._file is not None:
            self._file.close()
            self._file = None


def keep_earlier_runs(run_dir: Path, *, fresh: bool) -> None:
    """Move the previous start's files aside (numbered) before this start writes its own."""
    (run_dir / STOP_FILE).unlink(missing_ok=True)  # the previous start's stop: this start goes on
    names = [*_PER_START, *(_PER_HISTORY if fresh else ())]
    present = [name for name in names if (run_dir / name).exists()]
    if not present:
        return
    number = _next_number(run_dir)
    moved = []
    for name in present:
        stem, dot, suffix = name.partition(".")
        target = run_dir / f"{stem}.{number}{dot}{suffix}"
        os.replace(run_dir / name, target)
        moved.append(f"{name} -> {target.name}")
    if fresh and any(name in _PER_HISTORY for name in present):
        log.warning(
            "%s holds an earlier run with no checkpoint to resume: this run starts afresh; "
            "the earlier files are kept (%s)",
            run_dir,
            ", ".join(moved),
        )


def _next_number(run_dir: Path) -> int:
    pattern = re.compile(r"^(?:trace|recipe|metrics|eval)\.(\d+)\.(?:json|yaml|jsonl)$")
    numbers = [int(m.group(1)) for p in run_dir.iterdir() if (m := pattern.match(p.name))]
    return max(numbers, default=0) + 1


def record_stop(run_dir: Path, step: int) -> None:
    """Note that a clean stop ended this start after `step` train steps."""
    (run_dir / STOP_FILE).write_text(json.dumps({"stopped_at": step}) + "\n")


def stopped_at(run_dir: Path) -> int | None:
    """The step where a clean stop ended the run's latest start, or None (it finished, was
    killed, or still runs). A note that cannot be read counts as none: unreached gates fail."""
    try:
        step = json.loads((run_dir / STOP_FILE).read_text(encoding="utf-8"))["stopped_at"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None
