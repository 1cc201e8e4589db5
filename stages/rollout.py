"""Rollout: turns each admitted prompt into a group of `samples_per_prompt` completions.

Every request runs under deadlines on the pipeline clock: `generation_s` per engine call,
`sample_s` per group (retries included) and `batch_s` per batch, so time the engine spends
stood down is never charged. A failed call (timeout or engine error) is retried with exponential
backoff up to `max_retries`; then the group is dropped with a reason. A request the engine
rejects (`RequestRejected`: it asks for something the model cannot do) is dropped at once. More than
`max_dropped_groups` drops stop the run. A completion with a non-finite logprob is kept but
marked poisoned, so it is never trained on and never reaches a metric.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import Annotated

import anyio
import msgspec

from pipeline.channel import Channel
from pipeline.clock import DeadlineClock
from pipeline.errors import DeadlineExceeded, DropBudgetExceeded, RequestRejected
from pipeline.gate import EngineGate
from pipeline.logs import warn_once
from pipeline.messages import Batch, Completion, Dropped, Group, Prompt, Sample
from pipeline.recipe import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Section
from pipeline.trace import Trace
from pipeline.watchdog import Watchdog
from stages.timings import BatchTimings

log = logging.getLogger("stages.rollout")


class RolloutSection(Section):
    samples_per_prompt: Annotated[int, msgspec.Meta(ge=2)] = 8
    max_new_tokens: PositiveInt = 8
    temperature: NonNegativeFloat = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    generation_s: PositiveFloat = 120.0
    sample_s: PositiveFloat = 600.0
    batch_s: PositiveFloat = 3600.0
    max_retries: NonNegativeInt = 2
    backoff_s: NonNegativeFloat = 0.5
    max_dropped_groups: NonNegativeInt = 64


class _GiveUp(Exception):
    def __init__(self, reason: str) -> None:
        self.reason = reason


class RolloutStage:
    name = "rollout"

    def __init__(
        self,
        section: RolloutSection,
        *,
        gate: EngineGate,
        clock: DeadlineClock,
        inp: Channel[Batch],
        out: Channel[Group | Dropped],
        watchdog: Watchdog,
        trace: Trace | None = None,
        timings: BatchTimings | None = None,
    ) -> None:
        self.section = section
        self.gate = gate
        self.clock = clock
        self.inp = inp
        self.out = out
        self.watchdog = watchdog
        self.trace = trace or Trace(clock.source.now)
        self.timings = timings or BatchTimings()
        self.counts: Counter[str] = Counter()

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as batches:
                with self.watchdog.waiting(self.name, "a batch from the prompt stage"):
                    async for batch in self.inp:
                        batches.start_soon(self._run_batch, batch)
        finally:
            self.out.close()
            self.watchdog.done(self.name)

    async def _run_batch(self, batch: Batch) -> None:
        pending = {f"{batch.batch}-{i}": prompt for i, prompt in enumerate(batch.prompts)}
        try:
            with self.clock.fail_after(self.section.batch_s, f"batch {batch.batch}"):
                async with anyio.create_task_group() as groups:
                    for group_id, prompt in pending.items():
                        groups.start_soon(self._run_group, batch.batch, group_id, prompt, pending)
        except DeadlineExceeded:
            self.counts["timeouts"] += 1
            for group_id, prompt in list(pending.items()):
                await self._drop(prompt, group_id, batch.batch, "batch_timeout", pending)

    async def _run_group(self, batch: int, group_id: str, prompt: Prompt, pending: dict[str, Prompt]) -> None:
        start = self.clock.source.now()
        try:
            with self.clock.fail_after(self.section.sample_s, f"group {group_id}"):
                completions, versions = await self._generate(prompt, group_id)
        except DeadlineExceeded:
            self.counts["timeouts"] += 1
            await self._drop(prompt, group_id, batch, "sample_timeout", pending)
            return
        except _GiveUp as give_up:
            await self._drop(prompt, group_id, batch, give_up.reason, pending)
            return
        samples = tuple(
            Sample(
                prompt_id=prompt.prompt_id,
                group_id=group_id,
                sample_index=i,
                target_step=batch,
                gen_version=versions,
                prompt_tokens=prompt.tokens,
                tokens=c.tokens,
                logprobs=c.logprobs,
                finish_reason=c.finish_reason,
                poisoned=not all(math.isfinite(x) for x in c.logprobs),
            )
            for i, c in enumerate(completions)
        )
        self.timings.span(batch, "generate", start, self.clock.source.now())
        self.counts["poisoned_samples"] += sum(s.poisoned for s in samples)
        with self.watchdog.waiting(self.name, "room in the reward channel"):
            await self.out.send(Group(prompt=prompt, group_id=group_id, target_step=batch, samples=samples))
        # Only once sent: a batch timeout during the send drops the group instead of losing it.
        del pending[group_id]

    async def _generate(self, prompt: Prompt, group_id: str) -> tuple[list[Completion], tuple[int, int]]:
        section = self.section
        reason = ""
        for attempt in range(section.max_retries + 1):
            if attempt:
                self.counts["retries"] += 1
                await self.clock.sleep(section.backoff_s * 2 ** (attempt - 1))
            try:
                with self.clock.fail_after(section.generation_s, "generation request"):
                    with self.watchdog.waiting(self.name, "the generation engine"):
                        async with self.gate.serving() as first_version:
                            with self.trace.lane("rollout", f"generate {group_id}", attempt=attempt) as span:
                                completions = await self.gate.engine.generate(
                                    prompt.tokens, section.samples_per_prompt
                                )
                                span["version"] = first_version
                            return completions, (first_version, self.gate.engine_version)
            except DeadlineExceeded:
                self.counts["timeouts"] += 1
                reason = "generation_timeout"
            except RequestRejected as error:  # the same request would be refused again
                self.counts["engine_errors"] += 1
                raise _GiveUp(f"rejected: {error}") from None
            except Exception as error:  # an engine failure is retried like a timeout
                self.counts["engine_errors"] += 1
                reason = f"engine_error: {type(error).__name__}: {error}"
                warn_once(
                    log,
                    f"engine {type(error).__name__}",
                    "generation for %s failed (attempt %d): %s "
                    "(further engine errors of this kind are counted in rollout/engine_errors)",
                    prompt.prompt_id,
                    attempt + 1,
                    reason,
                )
        raise _GiveUp(reason)

    async def _drop(
        self, prompt: Prompt, group_id: str, batch: int, reason: str, pending: dict[str, Prompt]
    ) -> None:
        pending.pop(group_id, None)
        self.counts["dropped_groups"] += 1
        if self.counts["dropped_groups"] > self.section.max_dropped_groups:
            raise DropBudgetExceeded(
                f"{self.counts['dropped_groups']} groups dropped, over rollout.max_dropped_groups="
                f"{self.section.max_dropped_groups}; last reason: {reason}"
            )
        await self.out.send(
            Dropped(prompt_id=prompt.prompt_id, group_id=group_id, target_step=batch, reason=reason)
        )
