"""The suspendable deadline clock.

One `DeadlineClock` per pipeline measures inference service time. `now()` advances with the
injected time source except while the clock is suspended; suspensions nest, and the clock runs
again only when the outermost one ends. The engine gate suspends it while the engine is stood
down, so no request is charged for time the engine could not serve it.

Every deadline in the pipeline is created here (`fail_after`, `move_on_after`, `sleep`) and
tracked by the clock's timer task (`run`), which fires the earliest one when it expires. While
suspended, suspendable deadlines are frozen; wall-time deadlines (`suspendable=False`, used for
reward work, which the gate does not block) keep running on the same source.

All time is read through a `TimeSource`; `MonotonicTime` is the real one and
`pipeline.testing.FakeTime` a virtual one for tests that never sleep.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import anyio
import msgspec

from pipeline.contracts.errors import DeadlineExceeded

# A deadline this close to expiry counts as expired. Service time is source time minus the
# suspended total, so float rounding can leave a deadline 1 ulp short after sleeping exactly the
# computed delay; without the slack the timer would sleep ~1e-16 s again and again (a livelock on
# a fake source, a busy loop on a coarse real one).
_EXPIRY_SLACK_S = 1e-9


class TimeSource(Protocol):
    """Where time comes from: a monotonic reading and a way to wait for it to pass."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class MonotonicTime:
    """The real time source: `time.monotonic` and the event loop's sleep."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)


class ClockStatistics(msgspec.Struct, frozen=True):
    now: float
    suspend_depth: int
    suspended_total_s: float
    active_deadlines: int
    fired_deadlines: int


class _Deadline:
    __slots__ = ("expires_at", "fired", "scope", "suspendable")

    def __init__(self, expires_at: float, suspendable: bool) -> None:
        self.expires_at = expires_at
        self.suspendable = suspendable
        self.scope = anyio.CancelScope()
        self.fired = False


class DeadlineClock:
    """Service-time clock with nested suspension and deadlines that respect it.

    Lifecycle: create, start `run()` in the pipeline's task group, then use `fail_after` /
    `move_on_after` / `sleep` from any task of that group. Creating a deadline while `run()` is
    not running raises, so a deadline can never be silently ignored.
    """

    def __init__(self, source: TimeSource | None = None) -> None:
        self.source: TimeSource = source or MonotonicTime()
        self._depth = 0
        self._suspended_since = 0.0
        self._suspended_total = 0.0
        self._deadlines: set[_Deadline] = set()
        self._fired = 0
        self._running = False
        self._sleep_scope: anyio.CancelScope | None = None
        # Source time the timer task sleeps until: a new deadline expiring later needs no wake-up.
        self._wake_at = -math.inf

    # -- reading and suspending -------------------------------------------------------------

    def now(self) -> float:
        """Service time: source time minus every suspended interval."""
        if self._depth:
            return self._suspended_since - self._suspended_total
        return self.source.now() - self._suspended_total

    @property
    def suspended(self) -> bool:
        return self._depth > 0

    def suspend(self) -> None:
        if self._depth == 0:
            self._suspended_since = self.source.now()
        self._depth += 1
        self._changed()

    def resume(self) -> None:
        if self._depth == 0:
            raise RuntimeError("DeadlineClock.resume() without a matching suspend()")
        self._depth -= 1
        if self._depth == 0:
            self._suspended_total += self.source.now() - self._suspended_since
        self._changed()

    @contextmanager
    def suspended_while(self) -> Iterator[None]:
        self.suspend()
        try:
            yield
        finally:
            self.resume()

    def statistics(self) -> ClockStatistics:
        suspended_total = self._suspended_total
        if self._depth:
            suspended_total += self.source.now() - self._suspended_since
        return ClockStatistics(
            now=self.now(),
            suspend_depth=self._depth,
            suspended_total_s=suspended_total,
            active_deadlines=len(self._deadlines),
            fired_deadlines=self._fired,
        )

    # -- deadlines --------------------------------------------------------------------------

    @contextmanager
    def fail_after(self, seconds: float, what: str, *, suspendable: bool = True) -> Iterator[None]:
        """Cancel the body and raise `DeadlineExceeded(what)` once `seconds` have passed.

        Service time for suspendable deadlines, source (wall) time otherwise.
        """
        with self._deadline(seconds, suspendable) as deadline:
            yield
        if deadline.fired and deadline.scope.cancelled_caught:
            raise DeadlineExceeded(what, seconds)

    @contextmanager
    def move_on_after(self, seconds: float, *, suspendable: bool = True) -> Iterator[None]:
        """Cancel the body silently once `seconds` have passed."""
        with self._deadline(seconds, suspendable):
            yield

    async def sleep(self, seconds: float) -> None:
        """Sleep for `seconds` of service time (time stood down does not count)."""
        with self.move_on_after(seconds):
            await anyio.sleep_forever()

    @contextmanager
    def _deadline(self, seconds: float, suspendable: bool) -> Iterator[_Deadline]:
        if not self._running:
            raise RuntimeError("DeadlineClock.run() must be running before deadlines are set")
        start = self.now() if suspendable else self.source.now()
        deadline = _Deadline(start + seconds, suspendable)
        self._deadlines.add(deadline)
        # A suspendable deadline cannot expire while suspended (resuming wakes the timer).
        if not (suspendable and self._depth) and self.source.now() + seconds < self._wake_at:
            self._changed()
        try:
            with deadline.scope:
                yield deadline
        finally:
            self._deadlines.discard(deadline)

    def _remaining(self, deadline: _Deadline) -> float:
        if deadline.suspendable:
            return math.inf if self._depth else deadline.expires_at - self.now()
        return deadline.expires_at - self.source.now()

    def _fire_expired(self) -> float:
        """Fire every expired deadline; return the delay until the next one (inf if none)."""
        next_delay = math.inf
        for deadline in list(self._deadlines):
            remaining = self._remaining(deadline)
            if remaining <= _EXPIRY_SLACK_S:
                deadline.fired = True
                deadline.scope.cancel()
                self._deadlines.discard(deadline)
                self._fired += 1
            else:
                next_delay = min(next_delay, remaining)
        return next_delay

    def _changed(self) -> None:
        if self._sleep_scope is not None:
            self._sleep_scope.cancel()
            self._wake_at = -math.inf  # the timer recomputes before sleeping again

    async def run(self) -> None:
        """The timer task: fires deadlines as they expire. Runs until cancelled."""
        if self._running:
            raise RuntimeError("DeadlineClock.run() is already running")
        self._running = True
        try:
            while True:
                delay = self._fire_expired()
                self._wake_at = self.source.now() + delay
                with anyio.CancelScope() as self._sleep_scope:
                    if math.isinf(delay):
                        await anyio.sleep_forever()
                    else:
                        await self.source.sleep(delay)
                self._sleep_scope = None
        finally:
            self._running = False
            self._sleep_scope = None
            self._wake_at = -math.inf
