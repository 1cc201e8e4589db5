"""Fault injection from the recipe's `faults` section: off by default.

Wraps any engine so users and tests can check the guards end to end on a real model:
non-finite logprobs at a rate (per sample), extra engine latency (per call, on the clock's time
source, so it counts against generation deadlines) and engine crashes at a rate (per call).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated

import msgspec

from pipeline.clock import TimeSource
from pipeline.contracts.errors import RetryableEngineError
from pipeline.contracts.messages import Completion
from pipeline.contracts.protocols import Engine, KeepsEpisodes, PartialRollouts
from pipeline.contracts.sections import NonNegativeFloat, Section

Rate = Annotated[float, msgspec.Meta(ge=0, le=1)]


class FaultsSection(Section, frozen=True):
    nonfinite_logprob_rate: Rate = 0.0
    engine_latency_s: NonNegativeFloat = 0.0
    engine_crash_rate: Rate = 0.0

    @property
    def enabled(self) -> bool:
        return bool(self.nonfinite_logprob_rate or self.engine_latency_s or self.engine_crash_rate)


class InjectedEngineCrash(RetryableEngineError):
    """An engine failure injected by `faults.engine_crash_rate`."""


class FaultyEngine:
    def __init__(self, engine: Engine, section: FaultsSection, *, time: TimeSource, seed: int) -> None:
        self.engine = engine
        self.section = section
        self.time = time
        self.rng = random.Random(f"faults-{seed}")
        self.blocks_training = engine.blocks_training
        self.wake_carries_weights = engine.wake_carries_weights
        self.partial_rollouts = isinstance(engine, PartialRollouts) and engine.partial_rollouts

    @property
    def wakes(self) -> int:
        return self.engine.wakes  # type: ignore[attr-defined]

    async def generate(
        self, prompt_tokens: Sequence[int], n: int, *, greedy: bool = False, episode: str | None = None
    ) -> list[Completion]:
        if self.section.engine_latency_s:
            await self.time.sleep(self.section.engine_latency_s)
        if self.rng.random() < self.section.engine_crash_rate:
            raise InjectedEngineCrash("engine crash injected by faults.engine_crash_rate")
        completions = await self.engine.generate(prompt_tokens, n, greedy=greedy, episode=episode)
        rate = self.section.nonfinite_logprob_rate
        return [
            msgspec.structs.replace(c, logprobs=(math.nan, *c.logprobs[1:]))
            if c.logprobs and not greedy and self.rng.random() < rate
            else c
            for c in completions
        ]

    def end_episode(self, episode: str) -> None:
        if isinstance(self.engine, KeepsEpisodes):
            self.engine.end_episode(episode)

    async def stand_down(self) -> None:
        await self.engine.stand_down()

    async def wake(self) -> None:
        await self.engine.wake()

    async def refit(self) -> None:
        await self.engine.refit()

    def memory_in_use(self) -> int | None:
        return self.engine.memory_in_use()

    def fingerprint(self) -> Mapping[str, int] | None:
        return self.engine.fingerprint()

    def save(self, directory: Path) -> None:
        self.engine.save(directory)

    def load(self, directory: Path) -> None:
        self.engine.load(directory)

    def close(self) -> None:
        self.engine.close()
