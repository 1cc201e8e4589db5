"""The runner: a stage's error reaches the caller, whatever the stage raised."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import anyio
import pytest

from pipeline.clock import DeadlineClock
from pipeline.contracts.errors import StageFailed
from pipeline.runner import StopRequest, run_stages, strict
from pipeline.testing import FakeTime
from pipeline.watchdog import Watchdog


class Stage:
    def __init__(self, name: str, body: Callable[[], Awaitable[None]]) -> None:
        self.name = name
        self.body = body

    async def run(self) -> None:
        await self.body()


async def run(*stages: Stage) -> None:
    """run_stages next to fake time's autojump; its error (not a group) reaches the caller."""
    fake = FakeTime()
    errors: list[BaseException] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(fake.autojump)
        try:
            await run_stages(
                stages,
                clock=DeadlineClock(fake),
                watchdog=Watchdog(fake, stall_s=1.0e9, fail=False),
                stop=StopRequest(),
                on_stop=lambda: None,
                grace_s=1.0,
            )
        except StageFailed as error:
            errors.append(error)
        tg.cancel_scope.cancel()
    if errors:
        raise errors[0]


async def forever() -> None:
    await anyio.sleep_forever()


async def raises_cancelled() -> None:
    raise asyncio.CancelledError()


async def interrupts() -> None:
    raise KeyboardInterrupt


async def child_raises_cancelled() -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(strict(raises_cancelled))
        await anyio.sleep_forever()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (raises_cancelled, "stage 'a' failed: CancelledError: "),
        (interrupts, "stage 'a' failed: KeyboardInterrupt: "),
        (
            child_raises_cancelled,
            "stage 'a' failed: StrayCancellation: raises_cancelled raised CancelledError though nothing "
            "cancelled it",
        ),
    ],
    ids=["cancelled-error", "keyboard-interrupt", "a-task-of-its-own-group"],
)
async def test_a_stage_that_ends_by_a_base_exception_fails_the_run(
    body: Callable[[], Awaitable[None]], message: str
) -> None:
    """A `CancelledError` nobody asked for would otherwise end the stage (anyio takes it for its
    group's own cancellation) and the run would look finished."""
    with pytest.raises(StageFailed) as raised:
        await run(Stage("a", body), Stage("b", forever))
    assert str(raised.value) == message


async def test_strict_lets_a_real_cancellation_through() -> None:
    reached = anyio.Event()

    async def waits() -> None:
        reached.set()
        await anyio.sleep_forever()

    async with anyio.create_task_group() as tg:  # a StrayCancellation would fail the group
        tg.start_soon(strict(waits))
        await reached.wait()
        tg.cancel_scope.cancel()
    assert tg.cancel_scope.cancelled_caught


def test_reclaim_signals_takes_sigterm_back_from_native_code() -> None:
    """Native code (Ray's driver) may install its own SIGTERM handler under Python's: after
    `reclaim_signals` the signal reaches Python's handler again."""
    import ctypes
    import os
    import signal

    from pipeline.runner import reclaim_signals

    got: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        libc = ctypes.CDLL(None)
        libc.signal.restype = ctypes.c_void_p
        libc.signal(int(signal.SIGTERM), ctypes.c_void_p(1))  # SIG_IGN, behind Python's back
        reclaim_signals()
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs at the interpreter's next check
            if got:
                break
        assert got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)
