"""`with_retries`, the rollout stage's retry loop, on fake time: a failed attempt is retried
after an exponential backoff (backoff_s, 2 x backoff_s, ...), each retry counted, and the
attempts that run out give up with the last reason."""

from __future__ import annotations

from collections import Counter

import anyio
import pytest

from pipeline.clock import DeadlineClock
from pipeline.testing import EngineCrash, FakeTime
from stages.rollout import GiveUp, RolloutSection, with_retries


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
