"""What the pipeline needs from compute backends.

Backends implement these with plain synchronous code wrapped in worker threads (torch) or as
awaited remote calls (Ray); the pipeline only ever awaits them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from pipeline.messages import Completion, Sample


class Engine(Protocol):
    """A generation engine.

    `blocks_training`: it shares the trainer's devices and must stand down for each train step.
    `wake_carries_weights`: waking it serves the newest weights, so no separate refit is needed.
    """

    blocks_training: bool
    wake_carries_weights: bool

    async def generate(
        self, prompt_tokens: Sequence[int], n: int, *, greedy: bool = False
    ) -> list[Completion]: ...

    async def stand_down(self) -> None: ...

    async def wake(self) -> None: ...

    async def refit(self) -> None: ...

    def memory_in_use(self) -> int | None: ...

    def fingerprint(self) -> Mapping[str, int] | None:
        """A checksum per weight tensor of what it serves, as of its last wake or refit (None:
        none taken). Compared with `Trainer.fingerprint` by the gate's handoff checks."""
        ...


class Trainer(Protocol):
    """Turns a batch of scored samples into one optimizer step (policy version + 1)."""

    async def train_step(
        self, samples: Sequence[Sample], advantages: Sequence[float]
    ) -> Mapping[str, float]: ...

    def fingerprint(self) -> Mapping[str, int] | None:
        """A checksum per weight tensor of the weights it published with its last step (or
        loaded), in the engine's names; None: none taken."""
        ...
