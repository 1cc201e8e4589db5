"""The suspendable deadline clock.

One `DeadlineClock` per pipeline measures inference service time. `now()` advances with the
injected time source except while the clock is suspended; suspensions nest, and the clock runs
again only when the outermost one ends. The engine gate suspends it while the engine is stood
down, so no request is charged for time the engine could not serve it.

Every deadline in the pipeline is created here (`fail_after`, `move_on_after`, `sleep`) and
tracked by the clock's timer task (`run`), which fires the earliest one when it expires. While
suspended, suspendable deadlines are frozen; wall-time deadlines (`suspendable=False`, used for
reward work, which the gate does not block) keep running on the same source. A `Bound` (`bound`)
is a deadline without a cancel scope of its own, which the deadlines entered within it end at:
an outer deadline whose body awaits only under inner ones costs no scope.

All time is read through a `TimeSource`; `MonotonicTime` is the real one and
`pipeline.testing.FakeTime` a virtual one for tests that never sleep.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from types import TracebackType
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


class Bound:
    """A service-time deadline that opens no cancel scope of its own: the deadlines entered
    within it (`fail_after`, `move_on_after`, `sleep` with ``within=``) end at it where it comes
    first, and raise its `DeadlineExceeded` then. Code that awaits only under such deadlines is
    bounded by it as by `fail_after(seconds, what)`, one cancel scope fewer (an episode's turn
    bounds its attempts and their backoff sleeps so). `fired` is set once it has ended one."""

    __slots__ = ("expires_at", "fired", "seconds", "what")

    def __init__(self, expires_at: float, seconds: float, what: str) -> None:
        self.expires_at = expires_at
        self.seconds = seconds
        self.what = what
        self.fired = False

    def exceeded(self) -> DeadlineExceeded:
        return DeadlineExceeded(self.what, self.seconds)


class _Deadline:
    """One deadline of a clock and the cancel scope it fires: the context manager that
    `fail_after` and `move_on_after` return (a class, not a generator: every turn of an episode
    enters several)."""

    __slots__ = (
        "clock",
        "ends_at_bound",
        "expires_at",
        "fired",
        "scope",
        "seconds",
        "suspendable",
        "what",
        "within",
    )

    def __init__(
        self, clock: DeadlineClock, seconds: float, what: str | None, suspendable: bool, within: Bound | None
    ) -> None:
        assert within is None or suspendable, "a bound is service time: only suspendable deadlines end at one"
        self.clock = clock
        self.seconds = seconds
        self.what = what  # None: cancel silently (move_on_after)
        self.suspendable = suspendable
        self.within = within
        self.ends_at_bound = False
        self.fired = False
        self.expires_at = math.inf
        self.scope: anyio.CancelScope | None = None

    def __enter__(self) -> None:
        clock = self.clock
        if clock._scope_class is None:
            raise RuntimeError("DeadlineClock.run() must be running before deadlines are set")
        wall = clock.source.now()
        if not self.suspendable:
            now = wall
        elif clock._depth:
            now = clock._suspended_since - clock._suspended_total
        else:
            now = wall - clock._suspended_total
        self.expires_at = now + self.seconds
        if self.within is not None and self.within.expires_at <= self.expires_at:
            self.expires_at = self.within.expires_at
            self.ends_at_bound = True
        clock._deadlines.add(self)
        # A suspendable deadline cannot expire while suspended (resuming wakes the timer).
        if not (self.suspendable and clock._depth) and wall + (self.expires_at - now) < clock._wake_at:
            clock._changed()
        self.scope = scope = clock._scope_class()
        scope.__enter__()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> bool:
        self.clock._deadlines.discard(self)
        assert self.scope is not None  # entered
        swallowed = self.scope.__exit__(kind, error, traceback)
        if self.fired and self.scope.cancelled_caught:
            if self.ends_at_bound:
                assert self.within is not None  # set with it
                self.within.fired = True
                raise self.within.exceeded() from None
            if self.what is not None:
                raise DeadlineExceeded(self.what, self.seconds) from None
        return bool(swallowed)


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
        # The event loop's cancel scope class, looked up once (anyio.CancelScope() finds the
        # running backend on every call); None while `run()` is not running.
        self._scope_class: Callable[[], anyio.CancelScope] | None = None
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

    def bound(self, seconds: float, what: str) -> Bound:
        """A deadline `seconds` of service time from now that the deadlines given it as
        ``within`` end at (`Bound`); it cancels nothing by itself."""
        return Bound(self.now() + seconds, seconds, what)

    def fail_after(
        self, seconds: float, what: str, *, suspendable: bool = True, within: Bound | None = None
    ) -> AbstractContextManager[None]:
        """Cancel the body and raise `DeadlineExceeded(what)` once `seconds` have passed (or
        ``within``'s, at ``within``'s end where that comes first).

        Service time for suspendable deadlines, source (wall) time otherwise.
        """
        return _Deadline(self, seconds, what, suspendable, within)

    def move_on_after(
        self, seconds: float, *, suspendable: bool = True, within: Bound | None = None
    ) -> AbstractContextManager[None]:
        """Cancel the body silently once `seconds` have passed (but raise ``within``'s
        `DeadlineExceeded` at its end, where that comes first)."""
        return _Deadline(self, seconds, None, suspendable, within)

    async def sleep(self, seconds: float, *, within: Bound | None = None) -> None:
        """Sleep for `seconds` of service time (time stood down does not count); raise
        ``within``'s `DeadlineExceeded` if it ends first."""
        with self.move_on_after(seconds, within=within):
            await anyio.sleep_forever()

    def _fire_expired(self) -> float:
        """Fire every expired deadline; return the delay until the next one (inf if none).

        Both readings are taken once: a stand-down's suspend and resume scan every deadline of
        every episode in flight."""
        wall = self.source.now()
        service = self.now()
        suspended = self._depth > 0
        next_delay = math.inf
        expired: list[_Deadline] = []
        for deadline in self._deadlines:
            if not deadline.suspendable:
                remaining = deadline.expires_at - wall
            elif suspended:
                continue
            else:
                remaining = deadline.expires_at - service
            if remaining <= _EXPIRY_SLACK_S:
                expired.append(deadline)
            elif remaining < next_delay:
                next_delay = remaining
        for deadline in expired:
            deadline.fired = True
            assert deadline.scope is not None  # registered on entering its scope
            deadline.scope.cancel()
            self._deadlines.discard(deadline)
            self._fired += 1
        return next_delay

    def _changed(self) -> None:
        if self._sleep_scope is not None:
            self._sleep_scope.cancel()
            self._wake_at = -math.inf  # the timer recomputes before sleeping again

    async def run(self) -> None:
        """The timer task: fires deadlines as they expire. Runs until cancelled."""
        if self._scope_class is not None:
            raise RuntimeError("DeadlineClock.run() is already running")
        self._scope_class = type(anyio.CancelScope())
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
            self._scope_class = None
            self._sleep_scope = None
            self._wake_at = -math.inf
