"""Rollout: turns each admitted prompt into a group of `samples_per_prompt` completions.

Every request runs under deadlines on the pipeline clock: `generation_s` per engine call,
`sample_s` per group (retries included) and `batch_s` per batch, so time the engine spends
stood down is never charged. A failed call (a timeout, or a `RetryableEngineError`: the engine's
infrastructure failed) is retried with exponential backoff up to `max_retries`; then the group
is dropped with a reason. A request the engine rejects (`RequestRejected`: it asks for something
the model cannot do) is dropped at once. Any other exception from the engine is a bug: it fails
the run at once, with its traceback. More than
`max_dropped_groups` drops stop the run. A completion with a non-finite logprob is kept but
marked poisoned, so it is never trained on and never reaches a metric.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

import anyio
import msgspec

from pipeline.channel import Channel
from pipeline.clock import Bound, DeadlineClock
from pipeline.contracts.errors import (
    DeadlineExceeded,
    DropBudgetExceeded,
    RequestRejected,
    RetryableEngineError,
)
from pipeline.contracts.messages import Batch, Completion, Dropped, Group, Prompt, Sample
from pipeline.contracts.sections import (
    BenchLengths,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Section,
)
from pipeline.gate import EngineGate
from pipeline.logs import warn_once
from pipeline.runner import strict
from stages.context import RunContext

if TYPE_CHECKING:
    from stages.episodes import Episode, Episodes

log = logging.getLogger("stages.rollout")


class RolloutSection(Section, frozen=True):
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
    # Colocated: at a stand-down the requests in flight freeze with their tokens so far and
    # continue after the wake under the new weights, instead of the stand-down waiting for them.
    partial: bool = False
    # The most rows (samples) one decode loop generates at once, 0: as many as wait when it
    # opens (a batch's, or two batches' at L >= 1). With a cap, later requests enter as rows
    # finish and free their slots: long-tailed lengths keep the slots busy with the next batch.
    max_rows: NonNegativeInt = 0
    # A benchmark aid (off by default): end each sample at a length drawn from a lognormal
    # distribution, as if the model had emitted end-of-sequence (`backends/bench_lengths.py`).
    bench_lengths: BenchLengths | None = None
    # What generates: `torch`, our engine, or `megatron`, megatron-core's dynamic inference
    # engine serving the megatron trainer's own model in place (`backends/megatron/rules.py` says
    # where).
    engine: Literal["torch", "megatron"] = "torch"
    # engine megatron: its KV cache in GiB; 0 derives it from the batch (backends/megatron/serve.py).
    kv_cache_gb: NonNegativeFloat = 0.0
    # engine megatron: replay its decode steps from CUDA graphs (false: each step launched from
    # Python); the torch engine always does on CUDA (backends/megatron/serve.py).
    graphs: bool = False
    # engine megatron: the kernels its attention runs. `adapter`: torch's flash kernels and our
    # Triton paged decode kernel (backends/megatron/flash_adapter.py); `flash-attn-4`: megatron's
    # own path over the flash-attn-4 package (installed separately, 4.0.0b20 or later).
    attention: Literal["adapter", "flash-attn-4"] = "adapter"
    # Multi-turn rollouts (stages/episodes.py): `module:Class` of an environment
    # (pipeline/contracts/environments.py), built once per episode with `environment_args` as
    # its keyword arguments. Its episodes' rewards replace `reward.function`.
    environment: str | None = None
    environment_args: dict[str, Any] = msgspec.field(default_factory=dict)
    episode_reward: Literal["sum", "final"] = "final"  # the sum of the turns' rewards, or the last
    max_turns: PositiveInt = 8  # generation turns an episode may take (past it: truncated)
    # Tokens after the prompt an episode may hold, its turns' and the environment's (a turn
    # starts only if `max_new_tokens` more still fit; past it: truncated).
    max_episode_tokens: PositiveInt = 256
    turn_s: PositiveFloat = 300.0  # one generation turn, retries included (service time)
    env_s: PositiveFloat = 60.0  # one environment call (wall time: not suspended at a stand-down)
    max_env_failures: NonNegativeInt = 64  # episodes failed by their environment; past it the run stops
    # With prompts.chat_template: the role of the environment's messages (stages/chat_turns.py).
    # `tool`, as its replies are tool or environment output, not the user's words (and a template
    # may treat a user message as a new query: Qwen3's drops the reasoning of turns before one);
    # `user` for a template without a tool role.
    observation_role: Literal["tool", "user"] = "tool"
    # The torch engine keeps each episode's keys and values between its turns in up to this many
    # GiB of its device's memory (least recently kept evicted first), so a turn prefills only its
    # new tokens; 0 keeps none (every turn prefills its whole context: env/reprefilled_tokens).
    episode_kv_gb: NonNegativeFloat = 1.0

    def __post_init__(self) -> None:
        if self.environment is None and self.environment_args:
            raise ValueError("environment_args: given without rollout.environment (module:Class)")
        if self.environment is not None and self.max_new_tokens > self.max_episode_tokens:
            raise ValueError(
                f"max_new_tokens ({self.max_new_tokens}) must be <= max_episode_tokens "
                f"({self.max_episode_tokens}): no turn would fit in an episode"
            )


class GiveUp(Exception):
    """Every attempt at a generation request failed (or it was rejected); `reason` says how."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


T = TypeVar("T")


async def with_retries(
    attempt: Callable[[int], Awaitable[T]],
    section: RolloutSection,
    clock: DeadlineClock,
    counts: Counter[str],
    what: str,
    *,
    within: Bound | None = None,
) -> T:
    """`await attempt(n)` under `generation_s`, retried with backoff up to `max_retries` times.

    Timeouts and `RetryableEngineError`s are retried; a `RequestRejected` gives up at once; any
    other exception is a bug and propagates. Raises `GiveUp` when the attempts run out, and
    ``within``'s `DeadlineExceeded` when that bound ends an attempt or a backoff (`Bound`).
    """
    reason = ""
    for number in range(section.max_retries + 1):
        if number:
            counts["retries"] += 1
            await clock.sleep(section.backoff_s * 2 ** (number - 1), within=within)
        try:
            with clock.fail_after(section.generation_s, "generation request", within=within):
                return await attempt(number)
        except DeadlineExceeded:
            if within is not None and within.fired:
                raise  # the bound's: no retry
            counts["timeouts"] += 1
            reason = "generation_timeout"
        except RequestRejected as error:  # the same request would be refused again
            counts["engine_errors"] += 1
            raise GiveUp(f"rejected: {error}") from None
        except RetryableEngineError as error:
            counts["engine_errors"] += 1
            reason = f"engine_error: {type(error).__name__}: {error}"
            warn_once(
                log,
                f"engine {type(error).__name__}",
                "generation for %s failed (attempt %d): %s "
                "(further engine errors of this kind are counted in rollout/engine_errors)",
                what,
                number + 1,
                reason,
            )
    raise GiveUp(reason)


class RolloutStage:
    name = "rollout"

    def __init__(
        self,
        section: RolloutSection,
        *,
        gate: EngineGate,
        inp: Channel[Batch],
        out: Channel[Group | Dropped],
        context: RunContext,
        episodes: Episodes | None = None,
    ) -> None:
        """`episodes`: play multi-turn episodes against an environment (`rollout.environment`),
        each scored by it, instead of generating single completions."""
        self.section = section
        self.episodes = episodes
        self.gate = gate
        self.clock = context.clock
        self.inp = inp
        self.out = out
        self.watchdog = context.watchdog
        self.trace = context.trace
        self.timings = context.timings
        self.counts: Counter[str] = Counter()

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as batches:
                with self.watchdog.waiting(self.name, "a batch from the prompt stage"):
                    async for batch in self.inp:
                        batches.start_soon(strict(self._run_batch), batch)
        finally:
            self.out.close()
            self.watchdog.done(self.name)

    async def _run_batch(self, batch: Batch) -> None:
        pending = {f"{batch.batch}-{i}": prompt for i, prompt in enumerate(batch.prompts)}
        try:
            with self.clock.fail_after(self.section.batch_s, f"batch {batch.batch}"):
                async with anyio.create_task_group() as groups:
                    for group_id, prompt in pending.items():
                        groups.start_soon(strict(self._run_group), batch.batch, group_id, prompt, pending)
        except DeadlineExceeded:
            self.counts["timeouts"] += 1
            for group_id, prompt in list(pending.items()):
                await self._drop(prompt, group_id, batch.batch, "batch_timeout", pending)

    async def _run_group(self, batch: int, group_id: str, prompt: Prompt, pending: dict[str, Prompt]) -> None:
        start = self.clock.source.now()
        try:
            with self.clock.fail_after(self.section.sample_s, f"group {group_id}"):
                if self.episodes is not None:
                    episodes = await self._play(prompt, group_id, batch)
                else:
                    completions, versions = await self._generate(prompt, group_id)
        except DeadlineExceeded:
            self.counts["timeouts"] += 1
            await self._drop(prompt, group_id, batch, "sample_timeout", pending)
            return
        except GiveUp as give_up:
            await self._drop(prompt, group_id, batch, give_up.reason, pending)
            return
        samples = (
            episodes
            if self.episodes is not None
            else tuple(
                Sample(
                    prompt_id=prompt.prompt_id,
                    group_id=group_id,
                    sample_index=i,
                    target_step=batch,
                    gen_version=(stretches[0][1], stretches[-1][1]) if c.segments else versions,
                    tokens=c.tokens,
                    logprobs=c.logprobs,
                    finish_reason=c.finish_reason,
                    poisoned=not all(math.isfinite(x) for x in c.logprobs),
                    versions=stretches,
                    reprefilled_tokens=c.reprefilled_tokens,
                )
                for i, c in enumerate(completions)
                for stretches in [self._versions(c, versions[0])]
            )
        )
        self.timings.span(batch, "generate", start, self.clock.source.now())
        self.counts["poisoned_samples"] += sum(s.poisoned for s in samples)
        with self.watchdog.waiting(self.name, "room in the reward channel"):
            await self.out.send(Group(prompt=prompt, group_id=group_id, target_step=batch, samples=samples))
        # Only once sent: a batch timeout during the send drops the group instead of losing it.
        del pending[group_id]

    async def _play(self, prompt: Prompt, group_id: str, batch: int) -> tuple[Sample, ...]:
        """The group's episodes, played at once (multi-turn); raises `GiveUp` when one of
        them gives up its generation (the group is dropped, as a single-turn one would be)."""
        assert self.episodes is not None
        played: list[Episode | None] = [None] * self.section.samples_per_prompt
        gave_up: list[GiveUp] = []

        async def one(i: int, scope: anyio.CancelScope) -> None:
            try:
                played[i] = await self.episodes.run(prompt, counts=self.counts)  # type: ignore[union-attr]
            except GiveUp as give_up:
                gave_up.append(give_up)
                scope.cancel()

        with self.watchdog.waiting(self.name, "the episodes of a group"):
            async with anyio.create_task_group() as episodes:
                for i in range(len(played)):
                    episodes.start_soon(strict(one), i, episodes.cancel_scope)
        if gave_up:
            raise gave_up[0]
        samples = []
        for i, episode in enumerate(played):
            assert episode is not None
            versions = tuple(sorted(set(episode.versions))) or ((0, self.gate.engine_version),)
            samples.append(
                Sample(
                    prompt_id=prompt.prompt_id,
                    group_id=group_id,
                    sample_index=i,
                    target_step=batch,
                    gen_version=(versions[0][1], versions[-1][1]),
                    tokens=episode.tokens,
                    logprobs=episode.logprobs,
                    finish_reason=episode.finish_reason,
                    poisoned=not all(math.isfinite(x) for x in episode.logprobs),
                    text=self.episodes.tokenizer.decode(episode.tokens),
                    reward=episode.reward,
                    reward_info=episode.info,
                    versions=versions if len(versions) > 1 else (),
                    reprefilled_tokens=episode.continued_tokens,
                    loss_mask=episode.loss_mask,
                    episode=episode.stats,
                )
            )
        return tuple(samples)

    async def _generate(self, prompt: Prompt, group_id: str) -> tuple[list[Completion], tuple[int, int]]:
        async def attempt(number: int) -> tuple[list[Completion], tuple[int, int]]:
            with self.watchdog.waiting(self.name, "the generation engine"):
                async with self.gate.serving() as first_version:
                    with self.trace.lane("rollout", f"generate {group_id}", attempt=number) as lane:
                        completions = await self.gate.engine.generate(
                            prompt.tokens, self.section.samples_per_prompt
                        )
                        lane.args["version"] = first_version
                        self._trace_frozen(completions, lane.track)
                    return completions, (first_version, self.gate.engine_version)

        return await with_retries(attempt, self.section, self.clock, self.counts, prompt.prompt_id)

    def _versions(self, completion: Completion, first_version: int) -> tuple[tuple[int, int], ...]:
        """(first token index, weights version) of each stretch of ``completion``."""
        if not completion.segments:
            return ((0, first_version),)
        return tuple((start, self.gate.version_after(wakes)) for start, wakes in completion.segments)

    def _trace_frozen(self, completions: list[Completion], track: str) -> None:
        """A `frozen` span inside the request's own for each stand-down it lived through
        between its first token and its last (partial rollouts)."""
        wakes = [w for c in completions for _, w in c.segments]
        if wakes:
            for wake in range(min(wakes) + 1, max(wakes) + 1):
                start, end = self.gate.frozen_window(wake)
                self.trace.span("frozen", start, end, track=track, wake=wake)

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
