"""Held-out evaluation: greedy generation on prompts never trained on, scored by the reward.

With an environment (`rollout.environment`), each held-out prompt is one greedy episode,
scored by the environment (an episode it fails scores 0); `eval/reward` is their mean and the
final observations' `info` keys are logged as `eval/<key>`.

Generation is retried as rollout's is (`rollout.max_retries` attempts under `generation_s`);
the scoring runs under `reward.reward_s` of wall time for each `rollout.samples_per_prompt`
held-out answers (one training group's budget per group's worth of answers). When a prompt's
attempts run out or the scoring times out, that evaluation is skipped (`EvaluationSkipped`,
reported by the train stage, which goes on training); an engine error that is not retryable is
a bug and fails the run.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from statistics import fmean
from typing import TYPE_CHECKING, TypeVar

import anyio

from pipeline.clock import DeadlineClock
from pipeline.contracts.errors import DeadlineExceeded
from pipeline.contracts.messages import Prompt
from pipeline.contracts.sections import NonNegativeInt, PositiveInt, Section
from pipeline.gate import EngineGate
from pipeline.rewards.scoring import RewardFn, score_all
from pipeline.runner import strict
from stages.rollout import GiveUp, RolloutSection, with_retries

if TYPE_CHECKING:
    from stages.episodes import Episodes

T = TypeVar("T")


class EvalSection(Section, frozen=True):
    every_steps: NonNegativeInt = 0  # 0: no held-out evaluation
    num_prompts: PositiveInt = 256


class EvaluationSkipped(Exception):
    """This evaluation could not finish (engine failures past the retries, a scoring timeout)."""


class Evaluation:
    """Greedy generation on held-out prompts, scored by the recipe's reward function."""

    def __init__(
        self,
        section: EvalSection,
        *,
        prompts: Sequence[Prompt],
        fn: RewardFn,
        decode: Callable[[Sequence[int]], str],
        rollout: RolloutSection,
        reward_s: float,
        clock: DeadlineClock,
        episodes: Episodes | None = None,
    ) -> None:
        self.section = section
        self.episodes = episodes
        self.prompts = list(prompts)[: section.num_prompts]
        self.fn = fn
        self.decode = decode
        self.rollout = rollout
        # One training group's budget for each group's worth of held-out answers.
        self.scoring_s = reward_s * math.ceil(len(self.prompts) / rollout.samples_per_prompt)
        self.clock = clock
        self.counts: Counter[str] = Counter()  # retries, timeouts, engine_errors, skipped

    def due(self, step: int, last_step: int) -> bool:
        every = self.section.every_steps
        return bool(every) and (step % every == 0 or step == last_step)

    async def run(self, gate: EngineGate) -> dict[str, float]:
        """The evaluation's figures; raises `EvaluationSkipped` when it cannot finish."""
        if self.episodes is not None:
            return await self._episodes(self.episodes)

        async def answer(prompt: Prompt) -> str:
            async def attempt(number: int) -> str:
                async with gate.serving():
                    (completion,) = await gate.engine.generate(prompt.tokens, 1, greedy=True)  # type: ignore[call-arg]
                return self.decode(completion.tokens)

            return await with_retries(attempt, self.rollout, self.clock, self.counts, prompt.prompt_id)

        texts = await self._each_prompt(answer)
        try:
            with self.clock.fail_after(self.scoring_s, "evaluation scoring", suspendable=False):
                scored = await score_all(self.fn, list(zip(self.prompts, texts, strict=True)))
        except DeadlineExceeded as error:
            self.counts["skipped"] += 1
            per = self.rollout.samples_per_prompt
            raise EvaluationSkipped(f"{error} (reward.reward_s for each {per} answers)") from None
        # A reward that fails on a held-out answer scores it 0 rather than hiding the prompt.
        return _means([result if isinstance(result, dict) else {"reward": 0.0} for result in scored])

    async def _episodes(self, episodes: Episodes) -> dict[str, float]:
        """One greedy episode per held-out prompt, scored by its environment."""

        async def play(prompt: Prompt) -> dict[str, float]:
            episode = await episodes.run(prompt, counts=self.counts, greedy=True)
            return {"reward": episode.reward or 0.0, **episode.info}  # failed: 0

        return _means(await self._each_prompt(play))

    async def _each_prompt(self, generate: Callable[[Prompt], Awaitable[T]]) -> list[T]:
        """`generate` on every held-out prompt at once, results in prompt order. The first prompt
        whose attempts run out (`GiveUp`) stops the others and skips the evaluation."""
        results: list[T | None] = [None] * len(self.prompts)
        failures: list[str] = []

        async def one(i: int, prompt: Prompt, scope: anyio.CancelScope) -> None:
            try:
                results[i] = await generate(prompt)
            except GiveUp as failed:  # the evaluation is incomplete: stop its other requests
                failures.append(f"{prompt.prompt_id}: {failed.reason}")
                scope.cancel()

        async with anyio.create_task_group() as tg:
            for i, prompt in enumerate(self.prompts):
                tg.start_soon(strict(one), i, prompt, tg.cancel_scope)
        if failures:
            self.counts["skipped"] += 1
            raise EvaluationSkipped(f"generation for {failures[0]}")
        return [result for result in results if result is not None]


def _means(records: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({key for r in records for key in r})
    return {f"eval/{key}": fmean(r.get(key, 0.0) for r in records) for key in keys}
