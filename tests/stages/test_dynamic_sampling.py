"""DAPO's dynamic sampling through the real wiring (FakeEngine, FakeTrainer, fake time): a step
admits prompts_per_step x oversample prompts under one ticket and trains the first
prompts_per_step groups, in prompt order, whose rewards differ; the rest are counted."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from pipeline.channel import Channel
from pipeline.contracts.messages import Batch, Group, Prompt, TrainGroup, TrainSample
from pipeline.testing import FakeEngine, FakeTime, FakeTrainer
from stages.train import dynamic_sample
from tests.stages.test_flow import drive, make_recipe, metrics

_calls = itertools.count()


def half_spread(prompt: Prompt, completion: str) -> float:
    """Prompts whose first digit is odd: equal rewards (filtered); even: 0 then 1 (a group's
    samples are scored one after the other, one group at a time: `reward.concurrency` 1)."""
    if int(prompt.text[0]) % 2:
        return 0.5
    return float(next(_calls) % 2)


@pytest.fixture
def fake() -> FakeTime:
    return FakeTime()


def _group(index: int, rewards: list[float]) -> tuple[Group, TrainGroup]:
    samples = tuple(TrainSample(tokens=(1,), logprobs=(-1.0,), reward=r, advantage=0.0) for r in rewards)
    return None, TrainGroup(group_id=f"0-{index}", prompt_tokens=(1,), samples=samples)  # type: ignore[return-value]


def test_dynamic_sample_keeps_the_first_groups_with_a_spread() -> None:
    pairs = [_group(0, [1, 1]), _group(1, [0, 1]), _group(2, [0, 0]), _group(3, [1, 0]), _group(4, [0.5, 0])]
    kept, filtered, surplus = dynamic_sample(pairs, 2)
    assert [t.group_id for _, t in kept] == ["0-1", "0-3"]
    assert (filtered, surplus) == (2, 1)
    kept, filtered, surplus = dynamic_sample(pairs, 5)
    assert [t.group_id for _, t in kept] == ["0-1", "0-3", "0-4"] and (filtered, surplus) == (2, 0)


async def test_a_step_trains_only_groups_with_a_reward_spread(tmp_path: Path, fake: FakeTime) -> None:
    recipe = make_recipe(
        tmp_path,
        steps=4,
        reward={"function": f"{__name__}:half_spread", "concurrency": 1},
        train={"algorithm": "dapo", "oversample": 3.0},
    )
    trainer = FakeTrainer(time=fake)
    await drive(recipe, FakeEngine(time=fake), trainer, fake)
    lines = metrics(recipe)
    assert len(lines) == len(trainer.steps) == 4
    for line, groups in zip(lines, trainer.steps, strict=True):
        assert 0 < len(groups) <= 2  # prompts_per_step
        assert all(len({s.reward for s in g.samples}) > 1 for g in groups)
        # Three times prompts_per_step admitted: every group is trained, filtered or surplus.
        assert len(groups) + line["rollout/filtered_groups"] + line["rollout/surplus_groups"] == 6
    assert sum(line["rollout/filtered_groups"] for line in lines) > 0


async def test_without_dynamic_sampling_equal_rewards_are_trained(tmp_path: Path, fake: FakeTime) -> None:
    recipe = make_recipe(tmp_path, steps=2, reward={"function": f"{__name__}:half_spread", "concurrency": 1})
    trainer = FakeTrainer(time=fake)
    await drive(recipe, FakeEngine(time=fake), trainer, fake)
    assert [len(groups) for groups in trainer.steps] == [2, 2]
    assert "rollout/filtered_groups" not in metrics(recipe)[0]


async def test_a_resume_draws_the_prompts_an_uninterrupted_run_draws(
    tmp_path: Path, fake: FakeTime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step over-admits prompts_per_step x oversample prompts: a resume skips that many a
    trained batch, so batches 2-3 are generated from the same prompts as without the stop."""
    admitted: dict[str, dict[int, list[str]]] = {}
    original = Channel.send

    async def spy(self: Channel[Any], item: Any) -> None:
        if isinstance(item, Batch):
            admitted[run].setdefault(item.batch, []).extend(p.prompt_id for p in item.prompts)
        await original(self, item)

    monkeypatch.setattr(Channel, "send", spy)
    sections: dict[str, Any] = {"train": {"algorithm": "dapo", "oversample": 3.0}}
    for run, parts in (("whole", [4]), ("resumed", [2, 4])):
        admitted[run] = {}
        for steps in parts:
            recipe = make_recipe(tmp_path / run, steps=steps, lookahead=0, **sections)
            await drive(recipe, FakeEngine(time=fake), FakeTrainer(time=fake), fake)
    assert admitted["resumed"][2] == admitted["whole"][2] and len(admitted["whole"][2]) == 6
    assert admitted["resumed"][3] == admitted["whole"][3]
