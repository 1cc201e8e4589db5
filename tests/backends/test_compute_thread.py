"""ComputeThread: every call on one thread, and a cancelled caller waits for its call."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from backends.torch.compute import ComputeThread


async def test_every_call_runs_on_the_same_thread() -> None:
    compute = ComputeThread("test")
    try:
        idents = {await compute.run(threading.get_ident) for _ in range(20)}
        async with anyio.create_task_group() as tg:
            for _ in range(8):  # concurrent callers too
                tg.start_soon(lambda: compute.run(lambda: idents.add(threading.get_ident())))
    finally:
        compute.close()
    assert len(idents) == 1 and threading.get_ident() not in idents


async def test_a_cancelled_caller_waits_for_the_call_then_sees_the_cancellation() -> None:
    compute = ComputeThread("test")
    finished: list[float] = []

    def slow() -> str:
        time.sleep(0.2)
        finished.append(time.monotonic())
        return "done"

    try:
        with anyio.move_on_after(0.05) as scope:
            await compute.run(slow)
        assert scope.cancelled_caught
        assert finished, "the caller returned before the call it started had finished"
    finally:
        compute.close()


async def test_errors_reach_the_caller() -> None:
    compute = ComputeThread("test")
    try:
        with pytest.raises(ZeroDivisionError):
            await compute.run(lambda: 1 / 0)
    finally:
        compute.close()
