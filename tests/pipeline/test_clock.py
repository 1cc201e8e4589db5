"""The deadline clock: nested suspension, frozen reading, deadlines that skip suspended time."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.lowlevel
import pytest

from pipeline.clock import ClockStatistics, DeadlineClock
from pipeline.contracts.errors import DeadlineExceeded
from pipeline.testing import FakeTime


@pytest.fixture
def fake() -> FakeTime:
    return FakeTime()


@pytest.fixture
def clock(fake: FakeTime) -> DeadlineClock:
    return DeadlineClock(source=fake)


@asynccontextmanager
async def ticking(clock: DeadlineClock, fake: FakeTime) -> AsyncIterator[None]:
    """Run the clock's timer task, on fake time that jumps whenever every task is blocked.

    (A context manager, not a fixture: a task group must be left in the task that entered it.)
    """
    async with anyio.create_task_group() as tg:
        tg.start_soon(clock.run)
        tg.start_soon(fake.autojump)
        await anyio.sleep(0)
        yield
        tg.cancel_scope.cancel()


def test_nested_suspend_freezes_now_until_outermost_resume(fake: FakeTime) -> None:
    clock = DeadlineClock(source=fake)
    fake.advance(5)
    assert clock.now() == 5
    clock.suspend()
    fake.advance(3)
    assert clock.now() == 5
    clock.suspend()
    fake.advance(2)
    clock.resume()
    assert clock.suspended
    fake.advance(1)
    assert clock.now() == 5
    clock.resume()
    assert not clock.suspended
    fake.advance(4)
    assert clock.now() == 9


def test_resume_without_suspend_raises(fake: FakeTime) -> None:
    clock = DeadlineClock(source=fake)
    with pytest.raises(RuntimeError, match="without a matching suspend"):
        clock.resume()


def test_statistics_count_suspended_time_and_deadlines(fake: FakeTime) -> None:
    clock = DeadlineClock(source=fake)
    fake.advance(10)
    with clock.suspended_while():
        fake.advance(4)
        assert clock.statistics() == ClockStatistics(
            now=10, suspend_depth=1, suspended_total_s=4, active_deadlines=0, fired_deadlines=0
        )
    fake.advance(1)
    assert clock.statistics() == ClockStatistics(
        now=11, suspend_depth=0, suspended_total_s=4, active_deadlines=0, fired_deadlines=0
    )


def test_deadline_without_run_raises(fake: FakeTime) -> None:
    clock = DeadlineClock(source=fake)
    with pytest.raises(RuntimeError, match=r"run\(\) must be running"):
        with clock.fail_after(1, "work"):
            pass
    with pytest.raises(RuntimeError, match=r"run\(\) must be running"):
        with clock.move_on_after(1):
            pass


async def test_suspended_time_is_not_charged_to_a_deadline(clock: DeadlineClock, fake: FakeTime) -> None:
    async with ticking(clock, fake):
        # 10 s deadline, 8 s of work, 100 s suspended in the middle: no timeout.
        with clock.fail_after(10, "work"):
            await fake.sleep(4)
            with clock.suspended_while():
                await fake.sleep(100)
            await fake.sleep(4)
        assert fake.now() == 108
        assert clock.now() == 8
        assert clock.statistics().fired_deadlines == 0


async def test_deadline_that_truly_expires_fires(clock: DeadlineClock, fake: FakeTime) -> None:
    async with ticking(clock, fake):
        with pytest.raises(DeadlineExceeded) as raised:
            with clock.fail_after(10, "work"):
                await fake.sleep(4)
                with clock.suspended_while():
                    await fake.sleep(100)
                await fake.sleep(7)
        assert str(raised.value) == "work exceeded its deadline of 10 s"
        # It fired at 10 s of service time, not when the body would have finished.
        assert fake.now() == 110
        assert clock.statistics().fired_deadlines == 1
        assert clock.statistics().active_deadlines == 0


async def test_deadline_fires_while_body_waits_on_something_else(
    clock: DeadlineClock, fake: FakeTime
) -> None:
    async with ticking(clock, fake):
        # The body never touches the clock: only the timer task can end it.
        with pytest.raises(DeadlineExceeded):
            with clock.fail_after(3, "wait"):
                await anyio.Event().wait()
        assert fake.now() == 3


async def test_a_later_deadline_leaves_the_timer_asleep_and_an_earlier_one_wakes_it(
    clock: DeadlineClock, fake: FakeTime
) -> None:
    """The timer sleeps until its earliest deadline: a new one expiring later must not delay
    that wake-up, and a new one expiring sooner must bring it forward."""
    async with ticking(clock, fake):
        with pytest.raises(DeadlineExceeded, match="inner"):
            with clock.fail_after(10, "outer"):
                with clock.fail_after(20, "later"):
                    with clock.fail_after(1, "inner"):
                        await anyio.Event().wait()
        assert fake.now() == 1
        with pytest.raises(DeadlineExceeded, match="first"):
            with clock.fail_after(2, "first"):
                await anyio.sleep(0)  # the timer is asleep until t = 3
                with clock.fail_after(5, "later"):
                    await anyio.Event().wait()
        assert fake.now() == 3


async def test_wall_deadline_keeps_running_while_suspended(clock: DeadlineClock, fake: FakeTime) -> None:
    async with ticking(clock, fake):
        with clock.suspended_while():
            with pytest.raises(DeadlineExceeded):
                with clock.fail_after(5, "reward", suspendable=False):
                    await fake.sleep(50)
            assert fake.now() == 5
            # A suspendable deadline set now does not fire however long the suspension lasts.
            with clock.move_on_after(1):
                await fake.sleep(30)
            assert clock.statistics().fired_deadlines == 1


async def test_a_wall_deadline_set_after_a_suspension_runs_its_whole_length(
    clock: DeadlineClock, fake: FakeTime
) -> None:
    """Service time lags source time by every suspension: a wall deadline measured from service
    time would fire that much early."""
    async with ticking(clock, fake):
        with clock.suspended_while():
            await fake.sleep(20)
        start = fake.now()
        with pytest.raises(DeadlineExceeded):
            with clock.fail_after(5, "reward", suspendable=False):
                await fake.sleep(50)
        assert fake.now() - start == 5


class CountingTime(FakeTime):
    """Counts the sleeps asked of the source (the clock's timer and the test's own)."""

    sleeps = 0

    async def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        await super().sleep(seconds)


async def test_the_timer_sleeps_through_a_suspension_instead_of_waking_at_each_frozen_deadline() -> None:
    fake = CountingTime()
    clock = DeadlineClock(source=fake)
    async with ticking(clock, fake):
        with clock.move_on_after(5):
            with clock.suspended_while():
                await fake.sleep(100)
            await anyio.sleep_forever()
        assert fake.now() == 105
    # The test's sleep and the timer's once the suspension ended; a timer that slept the frozen
    # remainder would wake every 5 s of the suspension.
    assert fake.sleeps == 2


async def test_move_on_after_and_sleep_use_service_time(clock: DeadlineClock, fake: FakeTime) -> None:
    async with ticking(clock, fake):

        async def suspend_for_a_while() -> None:
            await fake.sleep(1)
            with clock.suspended_while():
                await fake.sleep(20)

        async with anyio.create_task_group() as tg:
            tg.start_soon(suspend_for_a_while)
            await clock.sleep(3)
        assert fake.now() == 23
        with clock.move_on_after(2):
            await anyio.sleep_forever()
        assert fake.now() == 25


async def test_deadline_set_after_a_suspension_fires(clock: DeadlineClock, fake: FakeTime) -> None:
    async with ticking(clock, fake):
        # Regression: with a suspended total of 0.2 s, service time 0.1 + 0.1 comes out one ulp short
        # of the deadline after sleeping exactly the computed delay; the timer then slept ~1e-16 s
        # forever (a livelock on fake time).
        fake.advance(0.1)
        with clock.suspended_while():
            await fake.sleep(0.2)
        with anyio.fail_after(5):  # a guard only: it does not sleep, it bounds a hang
            with pytest.raises(DeadlineExceeded):
                with clock.fail_after(0.1, "work"):
                    await anyio.sleep_forever()
        assert fake.now() == pytest.approx(0.4)


async def test_run_twice_raises(clock: DeadlineClock, fake: FakeTime) -> None:
    async with ticking(clock, fake):
        with pytest.raises(RuntimeError, match="already running"):
            await clock.run()


async def test_fake_time_stands_still_while_a_worker_thread_works(fake: FakeTime) -> None:
    """A task awaiting `anyio.to_thread.run_sync` is at work, not blocked: autojump does not
    move fake time under it (how long the thread takes on a loaded machine changes nothing).
    The thread waits a moment for the sleeper to wake, which it may only once the thread is done."""
    import threading

    woke = threading.Event()

    async def sleeper() -> None:
        await fake.sleep(1.0)
        woke.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(fake.autojump)
        tg.start_soon(sleeper)
        await anyio.lowlevel.checkpoint()  # both started: autojump watches the threads
        woke_meanwhile = await anyio.to_thread.run_sync(woke.wait, 0.5)
        assert (woke_meanwhile, fake.now()) == (False, 0.0)
        await anyio.sleep(0)
        while not woke.is_set():  # the thread is done: time moves on
            await anyio.wait_all_tasks_blocked()
        assert fake.now() == 1.0
        tg.cancel_scope.cancel()


async def test_a_deadline_within_a_bound_ends_at_the_bound_and_raises_its_error(
    clock: DeadlineClock, fake: FakeTime
) -> None:
    async with ticking(clock, fake):
        turn = clock.bound(10, "turn")
        with pytest.raises(DeadlineExceeded, match=r"^attempt exceeded"):
            with clock.fail_after(4, "attempt", within=turn):
                await anyio.sleep_forever()
        assert fake.now() == 4 and not turn.fired  # its own deadline came first
        # The timer sleeps until the outer deadline at 54 s; the attempt's, cut to the bound's
        # 10 s, wakes it.
        with clock.fail_after(50, "outer"), pytest.raises(DeadlineExceeded) as raised:
            await anyio.sleep(0)  # the timer is asleep until t = 54
            with clock.fail_after(100, "attempt", within=turn):
                await anyio.sleep_forever()
        assert str(raised.value) == "turn exceeded its deadline of 10 s"
        assert fake.now() == 10 and turn.fired
        assert clock.statistics().active_deadlines == 0


async def test_a_bound_is_service_time_and_ends_a_sleep_within_it(
    clock: DeadlineClock, fake: FakeTime
) -> None:
    async with ticking(clock, fake):
        turn = clock.bound(10, "turn")
        await fake.sleep(2)
        with clock.suspended_while():
            await fake.sleep(1000)  # stood down: not charged to the bound
        with pytest.raises(DeadlineExceeded, match=r"^turn exceeded"):
            await clock.sleep(100, within=turn)
        assert fake.now() == 1010 and turn.fired
        # A silent deadline within it raises the bound's error too, at once (it has ended).
        with pytest.raises(DeadlineExceeded, match=r"^turn exceeded"):
            with clock.move_on_after(5, within=clock.bound(0, "turn")):
                await anyio.sleep_forever()
        assert fake.now() == 1010
