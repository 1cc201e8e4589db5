"""Held-out evaluation: greedy generation on prompts never trained on, scored by the reward."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from statistics import fmean

import anyio

from pipeline.gate import EngineGate
from pipeline.messages import Prompt
from pipeline.recipe import NonNegativeInt, PositiveInt, Section
from stages.reward import RewardFn, score_all


class EvalSection(Section):
    every_steps: NonNegativeInt = 0  # 0: no held-out evaluation
    num_prompts: PositiveInt = 256


class Evaluation:
    """Greedy generation on held-out prompts, scored by the recipe's reward function."""

    def __init__(
        self,
        section: EvalSection,
        *,
        prompts: Sequence[Prompt],
        fn: RewardFn,
        decode: Callable[[Sequence[int]], str],
    ) -> None:
        self.section = section
        self.prompts = list(prompts)[: section.num_prompts]
        self.fn = fn
        self.decode = decode

    def due(self, step: int, last_step: int) -> bool:
        every = self.section.every_steps
        return bool(every) and (step % every == 0 or step == last_step)

    async def run(self, gate: EngineGate) -> dict[str, float]:
        texts: list[str] = [""] * len(self.prompts)

        async def one(i: int, prompt: Prompt) -> None:
            async with gate.serving():
                (completion,) = await gate.engine.generate(prompt.tokens, 1, greedy=True)  # type: ignore[call-arg]
            texts[i] = self.decode(completion.tokens)

        async with anyio.create_task_group() as tg:
            for i, prompt in enumerate(self.prompts):
                tg.start_soon(one, i, prompt)
        scored = await score_all(self.fn, list(zip(self.prompts, texts, strict=True)))
        # A reward that fails on a held-out answer scores it 0 rather than hiding the prompt.
        records = [result if isinstance(result, dict) else {"reward": 0.0} for result in scored]
        keys = sorted({key for r in records for key in r})
        return {f"eval/{key}": fmean(r.get(key, 0.0) for r in records) for key in keys}
