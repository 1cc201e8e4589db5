"""What the pipeline needs from compute backends.

Backends implement these with plain synchronous code wrapped in worker threads (torch) or as
awaited remote calls (Ray); the pipeline only ever awaits them. Engines and trainers are both
`Checkpointable`: a checkpoint holds what they save, a resume loads it, the run's end closes them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import msgspec

from pipeline.contracts.messages import Completion, TrainGroup


class Checkpointable(Protocol):
    """Backend state that checkpoints carry (a trainer's weights and optimizer, an engine's RNG).

    Called from a worker thread, never on the event loop. `save` writes the object's own files
    (names of its choosing, none of the pipeline's: see `stages.checkpoint`; an object without
    state writes none) into a step directory that is then committed by an atomic rename; `load`
    reads them back on resume; `close` lets go of threads and devices at the run's end (closing
    twice is harmless). `save` raises `NonFiniteState` (pipeline.contracts.errors) rather than write NaN
    or infinity; `load` raises `DamagedState` for files that are missing, torn or not finite,
    before it changes any state.
    """

    def save(self, directory: Path) -> None: ...

    def load(self, directory: Path) -> None: ...

    def close(self) -> None: ...


class Snapshot(Protocol):
    """A part's state as of its `snapshot`, held apart from the live state (host memory)."""

    def write(self) -> None:
        """Write the files `save` would have written at the snapshot, into its directory; on
        another thread than the snapshot's, while training goes on. Raises as `save` does."""
        ...


@runtime_checkable
class Snapshotting(Protocol):
    """A `Checkpointable` whose save splits in two (optional: a part without it is saved by
    `save` inside the step): `snapshot(directory)` copies its state now, quickly and only to
    memory, inside the train step (every rank of it, under tensor parallelism); the returned
    `Snapshot`'s `write()` writes it into `directory` later. One snapshot at a time: the next
    `snapshot` comes only after the last one's `write` returned, so its buffers may be reused."""

    def snapshot(self, directory: Path) -> Snapshot: ...


class Engine(Checkpointable, Protocol):
    """A generation engine.

    `blocks_training`: it shares the trainer's devices and must stand down for each train step.
    `wake_carries_weights`: waking it serves the newest weights, so no separate refit is needed.

    Optional capabilities are protocols of their own below (`PartialRollouts`,
    `SlotStatistics`, `KeepsEpisodes`), checked with `isinstance`.

    `generate`'s ``episode``: a key naming the multi-turn episode the request is a turn of (one
    row, ``n`` 1), for an engine that keeps an episode's keys and values between its turns
    (`KeepsEpisodes`); any other ignores it and prefills the whole prompt.
    """

    blocks_training: bool
    wake_carries_weights: bool

    async def generate(
        self, prompt_tokens: Sequence[int], n: int, *, greedy: bool = False, episode: str | None = None
    ) -> list[Completion]: ...

    async def stand_down(self) -> None: ...

    async def wake(self) -> None: ...

    async def refit(self) -> None: ...

    def memory_in_use(self) -> int | None: ...

    def fingerprint(self) -> Mapping[str, int] | None:
        """A checksum per weight tensor of what it serves, as of its last wake or refit (None:
        none taken). Compared with `Trainer.fingerprint` by the gate's handoff checks."""
        ...


class Trainer(Checkpointable, Protocol):
    """Turns a batch of scored groups into one optimizer step (policy version + 1).

    Groups come in prompt order, each with at least one sample; `train_step` returns the step's
    `train/*` metrics (`train/applied_updates` 0: every optimizer update was skipped).
    `completed_steps` counts the steps it has finished, loaded ones included: a step cancelled
    after its worker finished changed the weights unpublished, and must not be saved as the last.
    """

    @property
    def completed_steps(self) -> int: ...

    async def train_step(self, groups: Sequence[TrainGroup]) -> Mapping[str, float]: ...

    def fingerprint(self) -> Mapping[str, int] | None:
        """A checksum per weight tensor of the weights it published with its last step (or
        loaded), in the engine's names; None: none taken."""
        ...


@runtime_checkable
class PartialRollouts(Protocol):
    """An engine that can continue requests across a stand-down (`rollout.partial`): with
    `partial_rollouts` true it freezes the `generate` calls in flight at `stand_down` (their
    tokens so far kept, their device memory released) and continues them after `wake` under the
    new weights; the calls return only when done. It counts its `wake` calls in `wakes` and tags
    each stretch of a completion with that count (`Completion.segments`), so every token's
    weights version is known. An engine without it has partial rollouts off."""

    partial_rollouts: bool

    @property
    def wakes(self) -> int: ...


@runtime_checkable
class KeepsEpisodes(Protocol):
    """An engine that keeps an episode's keys and values between its turns: a turn whose
    prompt continues what the episode's last request ended with prefills only its new tokens
    (`Completion.reused_tokens`), where the engine still holds them (same weights, within its
    memory budget). `end_episode` tells it the episode has ended, so it can let them go;
    called from the event loop, it must not block."""

    def end_episode(self, episode: str) -> None: ...


class SlotStats(msgspec.Struct, frozen=True, kw_only=True):
    """An engine's running totals since it was built. A slot is one row of a decode loop's
    width for one decode step; it is busy while a row in it is generating."""

    slot_steps: int
    busy_slot_steps: int
    frozen_rows: int  # rows frozen at a stand-down, in all
    reprefilled_tokens: int  # tokens prefilled again to continue frozen rows (shared: once)
    frozen_now: int  # rows frozen and not yet continued
    # Where the decode loops' wall time went (0 from an engine that does not time them):
    decode_steps: int = 0
    loop_s: float = 0.0  # wall time inside decode loops
    loop_check_s: float = 0.0  # the host's work at the loops' checks, the device idle
    loop_prefill_s: float = 0.0  # prefilling admissions (and continued frozen rows)
    loop_wait_s: float = 0.0  # the host waiting at the checks for the device to catch up


@runtime_checkable
class SlotStatistics(Protocol):
    """An engine that reports how busy its decode slots were (`rollout/idle_slot_fraction`)."""

    def statistics(self) -> SlotStats: ...


@runtime_checkable
class Fingerprinted(Protocol):
    """A part that takes weight fingerprints for the gate's handoff checks (`Engine` and
    `Trainer` declare it; an engine or trainer an embedding application passes in may predate
    it, and its run goes unchecked)."""

    def fingerprint(self) -> Mapping[str, int] | None: ...
