"""The rollout stage on fake time: its retry loop (`with_retries`) retries a failed attempt
after an exponential backoff (backoff_s, 2 x backoff_s, ...), each retry counted, and gives up
with the last reason; `sample_s` bounds a group, retries included; a request's gen_version is
the versions of its first and last tokens (after a refit it spans, or a stand-down before its
first token); a batch timeout drops only the groups still generating, not those already sent
on (the whole pipeline on fakes, as tests/stages/test_flow.py runs it)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from pipeline.channel import Channel
from pipeline.clock import DeadlineClock
from pipeline.contracts.messages import Dropped, Group, TrainGroup
from pipeline.testing import EngineCrash, FakeEngine, FakeTime, FakeTrainer
from stages.rollout import GiveUp, RolloutSection, with_retries
from tests.stages.test_flow import drive, make_recipe, metrics


async def _attempts(failures: int, *, max_retries: int) -> tuple[list[float], Counter[str], object]:
    """Run `with_retries` on an attempt that crashes `failures` times; the fake times at which
    each attempt started, the counts and the result (or the `GiveUp`)."""
    fake = FakeTime()
    clock = DeadlineClock(source=fake)
    section = RolloutSection(max_retries=max_retries, backoff_s=0.5, generation_s=100.0)
    counts: Counter[str] = Counter()
    started: list[float] = []

    async def attempt(number: int) -> str:
        started.append(fake.now())
        if number < failures:
            raise EngineCrash(f"crash {number}")
        return "done"

    outcome: object = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(fake.autojump)
        tg.start_soon(clock.run)
        await anyio.wait_all_tasks_blocked()  # the clock's timer is running
        try:
            outcome = await with_retries(attempt, section, clock, counts, "prompt 0")
        except GiveUp as give_up:
            outcome = give_up
        tg.cancel_scope.cancel()
    return started, counts, outcome


async def test_a_failed_attempt_is_retried_after_an_exponential_backoff() -> None:
    started, counts, outcome = await _attempts(3, max_retries=3)
    assert outcome == "done"
    assert started == pytest.approx([0.0, 0.5, 1.5, 3.5])
    assert (counts["retries"], counts["engine_errors"]) == (3, 3)


async def test_attempts_that_run_out_give_up_with_the_last_reason() -> None:
    started, counts, outcome = await _attempts(5, max_retries=1)
    assert isinstance(outcome, GiveUp)
    assert outcome.reason == "engine_error: EngineCrash: crash 1"
    assert started == pytest.approx([0.0, 0.5])
    assert counts["retries"] == 1


async def test_a_batch_timeout_drops_only_the_groups_still_generating(tmp_path: Path) -> None:
    """Batch 0's first group is generated in 1 s and sent on; its second takes 50 s, past
    `batch_s` 10: only that one is dropped, and the first is trained."""
    fake = FakeTime()
    recipe = make_recipe(
        tmp_path,
        steps=2,
        lookahead=0,
        rollout={
            "samples_per_prompt": 2,
            "batch_s": 10.0,
            "sample_s": 100.0,
            "generation_s": 100.0,
            "max_retries": 0,
        },
    )
    trained: list[set[str]] = []

    def on_step(version: int, groups: Sequence[TrainGroup]) -> None:
        trained.append({g.group_id for g in groups})

    engine = FakeEngine(time=fake, latency=lambda call: 50.0 if call == 1 else 1.0)
    summary = await drive(recipe, engine, FakeTrainer(time=fake, on_step=on_step), fake)
    assert summary.steps_done == 2
    assert summary.dropped_groups == 1
    assert trained[0] == {"0-0"}
    assert metrics(recipe)[0]["rollout/dropped_groups"] == 1


async def test_sample_s_bounds_a_group_across_its_retries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group 0-0's first call runs past `generation_s` 10 and is retried at 10 s; the retry
    (8 s) would end at 18 s, inside its own `generation_s`, but `sample_s` 15 counts from the
    group's start, retries included: the group is dropped at 15 s as `sample_timeout`."""
    dropped: list[Dropped] = []
    original_send = Channel.send

    async def spy(self: Channel[Any], item: Any) -> None:
        if self.name == "generated" and isinstance(item, Dropped):  # the rollout's own drops
            dropped.append(item)
        await original_send(self, item)

    monkeypatch.setattr(Channel, "send", spy)
    fake = FakeTime()
    recipe = make_recipe(
        tmp_path,
        steps=2,
        lookahead=0,
        rollout={
            "samples_per_prompt": 2,
            "generation_s": 10.0,
            "sample_s": 15.0,
            "batch_s": 1000.0,
            "max_retries": 3,
            "backoff_s": 0.0,
        },
    )
    latencies = {0: 12.0, 2: 8.0}  # call 1 is group 0-1; call 2 is group 0-0's retry
    engine = FakeEngine(time=fake, latency=lambda call: latencies.get(call, 1.0))
    summary = await drive(recipe, engine, FakeTrainer(time=fake), fake)
    assert [(d.group_id, d.reason) for d in dropped] == [("0-0", "sample_timeout")]
    assert summary.dropped_groups == 1 and summary.steps_done == 2
    assert metrics(recipe)[-1]["rollout/timeouts"] == 2  # the first call's, and the group's


async def test_a_request_that_spans_a_refit_records_the_version_it_ended_under(
    tmp_path: Path, scored: dict[str, Group]
) -> None:
    """A separate engine at L 1: batch 1's requests (calls 2-3, 30 s) start under version 0 and
    step 0's refit (at 6 s) lands while they run, so their samples' gen_version is (0, 1); batch
    0's (1 s) and batch 2's (after the refit) run under one version each."""
    fake = FakeTime()
    recipe = make_recipe(tmp_path, steps=3, lookahead=1)
    engine = FakeEngine(
        time=fake, latency=lambda call: 30.0 if call in (2, 3) else 1.0, blocks_training=False
    )
    summary = await drive(recipe, engine, FakeTrainer(time=fake, latency=5.0), fake)
    assert summary.steps_done == 3
    versions = {(g.target_step, s.gen_version) for g in scored.values() for s in g.samples}
    assert versions == {(0, (0, 0)), (1, (0, 1)), (2, (1, 1))}


async def test_a_partial_request_records_the_versions_of_its_first_and_last_tokens(
    tmp_path: Path, scored: dict[str, Group]
) -> None:
    """Colocated with partial rollouts at L 1: batch 1's requests (calls 2-3) enter under
    version 0, but their first token (10 s in) comes after step 0's stand-down and wake (at 2
    s and 7 s), so every token is version 1's: gen_version (1, 1), not the version they entered
    under."""
    fake = FakeTime()
    recipe = make_recipe(tmp_path, steps=2, lookahead=1, rollout={"samples_per_prompt": 2, "partial": True})
    engine = FakeEngine(
        time=fake, latency=lambda call: 40.0 if call in (2, 3) else 2.0, response_len=4, partial_rollouts=True
    )
    summary = await drive(recipe, engine, FakeTrainer(time=fake, latency=5.0), fake)
    assert summary.steps_done == 2
    versions = {(g.target_step, s.gen_version) for g in scored.values() for s in g.samples}
    assert versions == {(0, (0, 0)), (1, (1, 1))}
