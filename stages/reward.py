"""The reward stage: scores every usable sample of a group with the recipe's reward function.

A reward function takes `(prompt: Prompt, completion: str)` and returns a float or a dict of
floats with a `"reward"` key (the other keys are logged as `reward/<key>`). `prompt.text` is
the prompt as the source gave it (before any chat template), `prompt.answer` the reference
answer, `prompt.prompt_id` its id; `completion` is the decoded text up to the end-of-sequence
token. It may be a plain or an `async` function; plain ones run in a worker thread. Built-ins
are named: `positional`, `exact_match`, `math` (math-verify equivalence of the final answer,
`stages.math_reward`) and `reasoning_gym` (the prompt source's own answer checker); anything
else is given as `module:function`, importable from the working directory or the environment.
Up to `concurrency` groups are scored at once, each under `reward_s` of wall time (the gate
does not block reward work); the cheap built-ins (`positional`, `exact_match`: microseconds a
sample) are scored on the event loop as each group arrives, with no thread or deadline. A
function that raises (an `Exception`, `SystemExit` or its own `CancelledError`) or returns a
non-finite value, or a group that times out, is a counted data failure: those samples get no
reward and are not trained on. More than `max_failures` failures stop the run. A function that
raises any other `BaseException` (`KeyboardInterrupt`) stops the run at once (`RewardAborted`).
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable

import anyio
import msgspec

from pipeline.channel import Channel
from pipeline.contracts.errors import DeadlineExceeded, DropBudgetExceeded
from pipeline.contracts.messages import Dropped, Group, Prompt, Sample
from pipeline.contracts.sections import NonNegativeInt, PositiveFloat, PositiveInt, Section
from pipeline.logs import warn_once
from pipeline.rewards.scoring import RewardFn, Scored, is_cheap, score_all, score_all_sync
from pipeline.rewards.threads import blocking_note
from pipeline.runner import strict
from stages.context import RunContext
from stages.tokenizer import Tokenizer

log = logging.getLogger("stages.reward")


class RewardSection(Section, frozen=True):
    function: str = "positional"
    reward_s: PositiveFloat = 60.0
    max_failures: NonNegativeInt = 64
    concurrency: PositiveInt = 8  # groups scored at once (worker threads, or awaits of an async function)


class RewardStage:
    name = "reward"

    def __init__(
        self,
        section: RewardSection,
        *,
        fn: RewardFn,
        tokenizer: Tokenizer,
        score: Callable[[list[tuple[Prompt, str | None]]], Awaitable[list[Scored]]] | None = None,
        inp: Channel[Group | Dropped],
        out: Channel[Group | Dropped],
        context: RunContext,
        scored_upstream: bool = False,
    ) -> None:
        """`scored_upstream`: groups arrive scored by their episodes' environment (multi-turn
        rollouts) and pass through unchanged."""
        self.section = section
        self.scored_upstream = scored_upstream
        self.trace = context.trace
        self.timings = context.timings
        self.fn = fn
        # `score`: where groups are scored instead of here (reward workers of the placement).
        self.score = score or functools.partial(score_all, fn)
        self.cheap = score is None and is_cheap(fn)
        self.tokenizer = tokenizer
        self.clock = context.clock
        self.inp = inp
        self.out = out
        self.watchdog = context.watchdog
        self.counts: Counter[str] = Counter()

    async def run(self) -> None:
        """Score up to `concurrency` groups at once; each is sent on as soon as it is scored."""
        slots = anyio.Semaphore(self.section.concurrency)
        try:
            async with anyio.create_task_group() as scoring:
                with self.watchdog.waiting(self.name, "a group from rollout"):
                    async for item in self.inp:
                        if not isinstance(item, Group) or self.scored_upstream:
                            await self.out.send(item)
                        elif self.cheap:  # scored in passing: no task, no slot
                            await self._score_and_send(item, None)
                        else:
                            await slots.acquire()
                            scoring.start_soon(strict(self._score_and_send), item, slots)
        finally:
            self.out.close()
            self.watchdog.done(self.name)

    async def _score_and_send(self, group: Group, slots: anyio.Semaphore | None) -> None:
        try:
            start = self.clock.source.now()
            with self.trace.lane("reward", f"score {group.group_id}"):
                scored = await self._score_group(group)
            self.timings.add(group.target_step, "reward", self.clock.source.now() - start)
            await self.out.send(scored)
            self.watchdog.beat(self.name)
        finally:
            if slots is not None:
                slots.release()

    async def _score_group(self, group: Group) -> Group:
        texts = [self.tokenizer.decode(s.tokens) for s in group.samples]
        wanted: list[str | None] = [
            None if s.poisoned else t for s, t in zip(group.samples, texts, strict=True)
        ]
        pairs = [(group.prompt, text) for text in wanted]
        results: list[Scored] = [None] * len(texts)
        if self.cheap:  # microseconds, on the event loop: no deadline could interrupt it
            results = score_all_sync(self.fn, pairs)
        else:
            try:
                with self.clock.fail_after(
                    self.section.reward_s, f"reward of group {group.group_id}", suspendable=False
                ):
                    results = await self.score(pairs)
            except DeadlineExceeded as error:
                self._failure("timeout", f"{error}{blocking_note()}")
        samples: list[Sample] = []
        for sample, text, result in zip(group.samples, texts, results, strict=True):
            if isinstance(result, Exception):
                self._failure(type(result).__name__, f"{type(result).__name__}: {result}")
                result = None
            info = dict(result or {})
            reward = info.pop("reward", None)
            samples.append(msgspec.structs.replace(sample, text=text, reward=reward, reward_info=info))
        return msgspec.structs.replace(group, samples=tuple(samples))

    def _failure(self, kind: str, reason: str) -> None:
        self.counts["failures"] += 1
        warn_once(log, kind, "reward failure: %s (further ones of this kind: reward/failures)", reason)
        if self.counts["failures"] > self.section.max_failures:
            raise DropBudgetExceeded(
                f"{self.counts['failures']} reward failures, over reward.max_failures="
                f"{self.section.max_failures}; last: {reason}"
            )
