"""The pipeline's own state in a checkpoint, beside the backend's: taken from the live run at a
save (`capture`) and put back into a new run's pieces at a resume (`restore`).

What it holds (`PipelineState`): the step and policy version, the next batch to admit, the
rollout and reward counters, the empty batches, Python's random state and the step's metrics
record. A resume also moves aside what the checkpoint does not continue (damaged checkpoints,
those of an abandoned branch), skips the prompts the saved steps admitted, and rewinds the
metrics files to the saved step.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from stages.checkpoint import (
    Checkpointer,
    PipelineState,
    Resumed,
    abandon_newer,
    python_rng_state,
    restore_metrics,
    set_aside,
    set_python_rng_state,
)
from stages.prompts import PromptSet

log = logging.getLogger("stages.program")  # the run's own lines, under the name users filter on


def capture(
    *,
    step: int,
    version: int,
    next_batch: int,
    rollout_counts: dict[str, int],
    reward_counts: dict[str, int],
    empty_batches: int,
    record: dict[str, Any] | None,
) -> PipelineState:
    """The pipeline's state at `step` (Python's random state read now)."""
    return PipelineState(
        step=step,
        policy_version=version,
        next_batch=next_batch,
        rollout_counts=dict(rollout_counts),
        reward_counts=dict(reward_counts),
        empty_batches=empty_batches,
        python_rng=python_rng_state(),
        last_record=record,
    )


def restore(
    resumed: Resumed, *, run_dir: Path, checkpoints: Checkpointer, prompts: PromptSet, admitted: int
) -> tuple[PipelineState, set[int]]:
    """Continue from `resumed` (its backend parts already loaded): the saved state and the steps
    already evaluated. `admitted` is the prompts a trained batch admitted (past the over-admission
    of dynamic sampling, which a resume skips as the run admitted it)."""
    state = resumed.state
    set_aside(resumed.damaged)
    abandon_newer(checkpoints.root, resumed)
    prompts.train.skip(state.next_batch * admitted)
    set_python_rng_state(state.python_rng)
    evaluated = restore_metrics(run_dir, state)
    checkpoints.last_step = state.step
    log.info("resumed from %s (step %d) in %.3f s", resumed.saved.path, state.step, resumed.load_s)
    return state, evaluated
