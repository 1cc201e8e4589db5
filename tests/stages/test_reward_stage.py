"""The reward stage on a group, with the run's real clock (fake time) and a scorer that takes
its time: the reward deadline runs on wall time even while the gate has the clock suspended (an
engine stood down for training), and the batch's reward seconds reach its timings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from pipeline.channel import Channel
from pipeline.clock import DeadlineClock
from pipeline.contracts.errors import DropBudgetExceeded
from pipeline.contracts.messages import Group, Prompt, Sample
from pipeline.metrics import MetricsLog
from pipeline.rewards.scoring import positional_reward
from pipeline.testing import FakeTime
from pipeline.trace import Trace
from pipeline.watchdog import Watchdog
from stages.context import RunContext
from stages.reward import RewardSection, RewardStage
from stages.timings import BatchTimings
from stages.tokenizer import CharTokenizer

TOKENIZER = CharTokenizer("0123456789=")


def _group() -> Group:
    prompt = Prompt(prompt_id="p0", text="12=", tokens=tuple(TOKENIZER.encode("12=")), answer="23")
    return Group(
        prompt=prompt,
        group_id="3-0",
        target_step=3,
        samples=tuple(
            Sample(
                prompt_id="p0",
                group_id="3-0",
                sample_index=i,
                target_step=3,
                gen_version=(0, 0),
                tokens=tuple(TOKENIZER.encode("23")[1:]),
                logprobs=(-1.0, -1.0),
                finish_reason="stop",
            )
            for i in range(2)
        ),
    )


def _context(tmp_path: Path, fake: FakeTime) -> RunContext:
    return RunContext(
        clock=DeadlineClock(source=fake),
        trace=Trace(fake.now),
        watchdog=Watchdog(fake, stall_s=1e9, fail=False),
        timings=BatchTimings(),
        metrics=MetricsLog(tmp_path),
    )


async def _score(
    tmp_path: Path, *, seconds: float, suspended: bool
) -> tuple[Group, RewardStage, BatchTimings]:
    """Score one group through `RewardStage.run` with a scorer (as the reward workers') that
    takes `seconds` of fake time, under `reward.reward_s: 10`."""
    fake = FakeTime()
    context = _context(tmp_path, fake)
    clock, timings = context.clock, context.timings

    async def slow(pairs: list) -> list:
        await fake.sleep(seconds)
        return [{"reward": 1.0}] * len(pairs)

    inp: Channel = Channel("scored-in", 1)
    out: Channel = Channel("scored-out", 1)
    stage = RewardStage(
        RewardSection(reward_s=10.0, max_failures=5),
        fn=positional_reward,
        tokenizer=TOKENIZER,
        score=slow,
        inp=inp,
        out=out,
        context=context,
    )
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(fake.autojump)
            tg.start_soon(clock.run)
            await anyio.wait_all_tasks_blocked()
            if suspended:
                clock.suspend()  # as the gate does for a stand-down
            tg.start_soon(stage.run)
            await inp.send(_group())
            inp.close()
            [scored] = [item async for item in out]
            tg.cancel_scope.cancel()
    finally:
        context.metrics.close()
    return scored, stage, timings


async def test_a_reward_deadline_fires_on_wall_time_while_the_clock_is_suspended(tmp_path: Path) -> None:
    """A reward that hangs while the engine is stood down still times out after reward_s."""
    scored, stage, timings = await _score(tmp_path, seconds=100.0, suspended=True)
    assert [s.reward for s in scored.samples] == [None, None]
    assert stage.counts["failures"] == 1
    assert timings.pop(3) == {"timing/reward_s": 10.0}


async def test_a_groups_reward_seconds_reach_its_batchs_timings(tmp_path: Path) -> None:
    scored, stage, timings = await _score(tmp_path, seconds=4.0, suspended=False)
    assert [s.reward for s in scored.samples] == [1.0, 1.0]
    assert stage.counts["failures"] == 0
    assert timings.pop(3) == {"timing/reward_s": 4.0}


async def _through_stage(
    tmp_path: Path, groups: list[Group], scorer: Any, section: RewardSection
) -> tuple[list[Group], RewardStage]:
    """Score `groups` through `RewardStage.run` with the scorer `scorer(fake time)` (pairs ->
    results)."""
    fake = FakeTime()
    score = scorer(fake)
    context = _context(tmp_path, fake)
    clock = context.clock
    inp: Channel = Channel("scored-in", len(groups))
    out: Channel = Channel("scored-out", len(groups))
    stage = RewardStage(
        section, fn=positional_reward, tokenizer=TOKENIZER, score=score, inp=inp, out=out, context=context
    )
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(fake.autojump)
            tg.start_soon(clock.run)
            tg.start_soon(stage.run)
            for group in groups:
                await inp.send(group)
            inp.close()
            scored = [item async for item in out]
            tg.cancel_scope.cancel()
    finally:
        context.metrics.close()
    return scored, stage


async def test_a_poisoned_sample_is_not_scored_and_a_failed_one_gets_no_reward(tmp_path: Path) -> None:
    group = _group()
    group = msgspec.structs.replace(
        group, samples=(group.samples[0], msgspec.structs.replace(group.samples[1], poisoned=True))
    )
    asked: list[list[str | None]] = []

    async def score(pairs: list) -> list:
        asked.append([text for _, text in pairs])
        return [ValueError("unparsable"), None]

    [scored], stage = await _through_stage(
        tmp_path, [group], lambda fake: score, RewardSection(max_failures=5)
    )
    assert asked == [["23", None]]
    assert [s.reward for s in scored.samples] == [None, None]
    assert stage.counts["failures"] == 1


async def test_at_most_concurrency_groups_are_scored_at_once(tmp_path: Path) -> None:
    at_once = peak = 0

    def scorer(fake: FakeTime) -> Any:
        async def score(pairs: list) -> list:
            nonlocal at_once, peak
            at_once += 1
            peak = max(peak, at_once)
            await fake.sleep(1)  # the others' turn, were they let in
            at_once -= 1
            return [{"reward": 1.0}] * len(pairs)

        return score

    scored, _ = await _through_stage(tmp_path, [_group()] * 6, scorer, RewardSection(concurrency=2))
    assert len(scored) == 6 and peak == 2


async def test_failures_past_the_budget_stop_the_stage(tmp_path: Path) -> None:
    async def score(pairs: list) -> list:
        return [ValueError("unparsable")] * len(pairs)

    budget = pytest.RaisesExc(DropBudgetExceeded, match=r"^2 reward failures, over reward.max_failures=1;")
    with pytest.RaisesGroup(budget, flatten_subgroups=True):
        await _through_stage(tmp_path, [_group()], lambda fake: score, RewardSection(max_failures=1))
