"""What the train stage hands a trainer of a scored group: advantages by the algorithm's
estimator over rewards shaped by its overlong penalty; poisoned and unscored samples left out."""

from __future__ import annotations

import pytest

from pipeline.algorithms.advantages import dr_grpo, grpo
from pipeline.algorithms.config import Algorithm
from pipeline.contracts.messages import Group, Prompt, Sample
from stages.train import train_group


def _group(lengths: list[int], rewards: list[float | None], poisoned: int = -1) -> Group:
    samples = tuple(
        Sample(
            prompt_id="p",
            group_id="0-0",
            sample_index=i,
            target_step=0,
            finish_reason="length",
            tokens=(3,) * n,
            logprobs=(-1.0,) * n,
            gen_version=(0, 0),
            reward=r,
            poisoned=i == poisoned,
        )
        for i, (n, r) in enumerate(zip(lengths, rewards, strict=True))
    )
    prompt = Prompt(prompt_id="p", tokens=(1, 2), text="12", answer="3")
    return Group(prompt=prompt, group_id="0-0", target_step=0, samples=samples)


def test_rewards_are_shaped_by_the_overlong_penalty_before_the_advantages() -> None:
    """max_response_tokens 10, buffer 4: lengths 6, 8, 10 lose 0, 0.5 and 1.0 (penalty 1.0)."""
    algorithm = Algorithm(overlong_buffer=4, max_response_tokens=10)
    trained = train_group(_group([6, 8, 10], [1.0, 1.0, 1.0]), algorithm)
    assert [s.reward for s in trained.samples] == [1.0, 0.5, 0.0]
    assert [s.advantage for s in trained.samples] == pytest.approx(grpo([1.0, 0.5, 0.0]))


def test_the_estimator_is_the_algorithms_and_unusable_samples_are_left_out() -> None:
    algorithm = Algorithm(advantage="dr_grpo")
    trained = train_group(_group([2, 2, 2, 2], [1.0, 0.0, None, 0.5], poisoned=3), algorithm)
    assert [s.reward for s in trained.samples] == [1.0, 0.0]
    assert [s.advantage for s in trained.samples] == pytest.approx(dr_grpo([1.0, 0.0]))
