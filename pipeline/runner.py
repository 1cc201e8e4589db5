"""Runs stages as tasks of one anyio task group, with the clock, the watchdog and clean stops.

- A stage is anything with a `name` and an async `run()`. A stage that raises cancels the
  others; the caller sees that stage's error (a `PipelineError` as it is, anything else wrapped
  in `StageFailed` naming the stage: a `KeyboardInterrupt`, or a cancellation that no cancel
  scope of the run explains, too, so a stage can never end the run as if it had finished).
- `StopRequest.request()` (first SIGINT/SIGTERM, or a host application) calls `on_stop` so the
  stages stop admitting work and drain; whatever has not finished `grace_s` later is cancelled.
"""

from __future__ import annotations

import functools
import logging
import math
import signal
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, ParamSpec, Protocol

import anyio

from pipeline.clock import DeadlineClock
from pipeline.contracts.errors import PipelineError, StageFailed
from pipeline.watchdog import Watchdog

P = ParamSpec("P")

log = logging.getLogger("pipeline.runner")


class Stage(Protocol):
    name: str

    async def run(self) -> None: ...


class StopRequest:
    """Asks a running pipeline to stop cleanly; safe to call from signal handlers on the loop."""

    def __init__(self) -> None:
        self.requested = anyio.Event()
        self.reason = ""

    def request(self, reason: str = "stop requested") -> None:
        if not self.requested.is_set():
            self.reason = reason
            self.requested.set()


class RunOutcome:
    def __init__(self) -> None:
        self.stopped = False
        self.cancelled_after_grace = False


async def run_stages(
    stages: Sequence[Stage],
    *,
    clock: DeadlineClock,
    watchdog: Watchdog,
    stop: StopRequest,
    on_stop: Callable[[], None],
    grace_s: float,
) -> RunOutcome:
    outcome = RunOutcome()
    cancelled = anyio.get_cancelled_exc_class()

    async def guard(stage: Stage) -> None:
        watchdog.register(stage.name)
        try:
            try:
                await stage.run()
            except BaseExceptionGroup as group:  # a stage's own task group: show its first error
                raise first_error(group) from None
        except PipelineError:
            raise
        except cancelled as error:
            if _cancelled_here():
                raise  # the run's own cancellation
            # Nothing cancelled the stage: ending as cancelled would let the run look finished.
            raise StageFailed(stage.name, error) from error
        except BaseException as error:  # KeyboardInterrupt, SystemExit: never out of a task
            raise StageFailed(stage.name, error) from error

    async def stopper(stage_scope: anyio.CancelScope) -> None:
        await stop.requested.wait()
        outcome.stopped = True
        log.warning("%s: stopping admission, draining in-flight work (grace %.0f s)", stop.reason, grace_s)
        on_stop()
        await clock.source.sleep(grace_s)
        outcome.cancelled_after_grace = True
        log.warning("grace period over: cancelling in-flight work")
        stage_scope.cancel()

    try:
        async with anyio.create_task_group() as services:
            services.start_soon(clock.run)
            services.start_soon(watchdog.run)
            async with anyio.create_task_group() as stage_group:
                services.start_soon(stopper, stage_group.cancel_scope)
                for stage in stages:
                    stage_group.start_soon(guard, stage)
            services.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise first_error(group) from None
    return outcome


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The error to show: the first leaf that is not a cancellation."""
    cancelled = anyio.get_cancelled_exc_class()
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            return first_error(error)
        if not isinstance(error, cancelled):
            return error
    return group


def _cancelled_here() -> bool:
    """Whether a cancel scope around the current task has been cancelled."""
    return anyio.current_effective_deadline() == -math.inf


class StrayCancellation(RuntimeError):
    """A task raised the cancellation exception though no cancel scope around it was cancelled."""


def strict(fn: Callable[P, Coroutine[Any, Any, None]]) -> Callable[P, Coroutine[Any, Any, None]]:
    """`fn` as a task of a task group, with a cancellation nothing asked for raised as
    `StrayCancellation`: anyio takes a task's own `CancelledError` for a cancellation of its whole
    group, which then ends as if its work were done (a stage closing its channel early, a run
    looking finished)."""

    @functools.wraps(fn)
    async def task(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            await fn(*args, **kwargs)
        except anyio.get_cancelled_exc_class() as error:
            if _cancelled_here():
                raise
            name = getattr(fn, "__qualname__", repr(fn))
            raise StrayCancellation(f"{name} raised CancelledError though nothing cancelled it") from error

    return task


WATCHED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def reclaim_signals() -> None:
    """Put Python's handlers back in charge of SIGINT and SIGTERM, where Python installed one.

    A library that starts native code may install its own handler underneath: Ray's driver
    installs a failure handler for SIGTERM that reports the signal as a crash and ends the
    process by SIGABRT after the run's clean stop has begun. Called after the backend starts,
    on the main thread (elsewhere handlers cannot be set, and nothing is done)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in WATCHED_SIGNALS:
        handler = signal.getsignal(signum)
        if callable(handler):  # Python's own (a host's, or the CLI's signal receiver)
            signal.signal(signum, handler)
