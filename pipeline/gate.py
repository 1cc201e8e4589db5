"""The engine gate: the handoff between generation and training.

States: serving -> standing_down -> down -> waking -> serving.

`step(train, save=...)` runs one train step in the order the engine's capabilities require,
never from a backend's name:

- `blocks_training` (colocated): close admission to new requests -> suspend the deadline clock
  -> drain in-flight requests -> stand the engine down -> train -> [save] -> wake (with a refit
  first if the wake does not carry weights) -> resume the clock -> reopen. Saving before the
  wake keeps the checkpoint write off the engine's memory peak.
- otherwise: train while the engine keeps serving -> refit the engine -> [save]. The refit
  waits for the engine's in-flight call inside the backend, not here.

Handoff checks (``checks``, `async_rl.handoff_checks`): after a stand-down the engine must
hold no memory it reports (`memory_in_use()` is 0 or None), and after each wake or refit the
engine's weight fingerprint must equal the trainer's (`fingerprint()`, taken by each side at
the handoff itself); otherwise the step fails with `HandoffMismatch` naming the tensors.

Partial rollouts (an engine with `partial_rollouts`): the stand-down does not wait for the
calls in flight; the engine freezes them (`Engine` says how) and they continue after the wake,
their `serving()` held throughout. The engine tags each stretch of a sequence with its count of
wakes (`wakes`); `version_after(wakes)` turns that into the weights version it served, and
`frozen_window(wakes)` gives the time from the stand-down before that wake to serving again.

Generation calls enter through `serving()`, which waits while the gate is not serving and
counts in-flight calls. Each transition's duration is returned by `step` and kept in
`statistics()`; the optional `on_transition(name, start, end)` hook feeds the trace.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import TypeVar

import anyio
import msgspec

from pipeline.clock import DeadlineClock
from pipeline.contracts.errors import HandoffMismatch
from pipeline.contracts.protocols import Engine, PartialRollouts, Trainer

T = TypeVar("T")


class GateState(enum.Enum):
    SERVING = "serving"
    STANDING_DOWN = "standing_down"
    DOWN = "down"
    WAKING = "waking"


class GateStatistics(msgspec.Struct, frozen=True):
    state: str
    engine_version: int
    in_flight: int
    waiting: int
    steps: int
    last_timings: dict[str, float]
    engine_memory_after_stand_down: int | None


TransitionHook = Callable[[str, float, float], None]


class EngineGate:
    def __init__(
        self,
        engine: Engine,
        clock: DeadlineClock,
        *,
        version: int = 0,
        on_transition: TransitionHook | None = None,
        checks: Trainer | None = None,
    ) -> None:
        self.engine = engine
        self.checks = checks
        self.clock = clock
        self.engine_version = version
        self._state = GateState.SERVING
        self._in_flight = 0
        self._waiting = 0
        self._changed = anyio.Event()
        self._steps = 0
        self._timings: dict[str, float] = {}
        self._memory_after_stand_down: int | None = None
        self._on_transition = on_transition
        partial = engine if isinstance(engine, PartialRollouts) and engine.partial_rollouts else None
        self.partial = partial is not None
        # Partial rollouts: the version served, and the frozen window, per count of engine wakes.
        self._versions: dict[int, int] = {partial.wakes: version} if partial is not None else {}
        self._windows: dict[int, tuple[float, float]] = {}
        self._down_since = 0.0

    @property
    def state(self) -> GateState:
        return self._state

    def version_after(self, wakes: int) -> int:
        """The weights version the engine served after its `wakes`-th wake (partial rollouts)."""
        return self._versions[wakes]

    def frozen_window(self, wakes: int) -> tuple[float, float]:
        """From the stand-down before the engine's `wakes`-th wake to serving again."""
        return self._windows[wakes]

    def serving(self) -> AbstractAsyncContextManager[int]:
        """Hold the engine for one call; yields the weights version it serves."""
        return _Serving(self)

    async def step(
        self,
        train: Callable[[], Awaitable[T]],
        *,
        save: Callable[[], Awaitable[None]] | None = None,
    ) -> tuple[T, dict[str, float]]:
        """Run one train step in the capability-driven order; returns its result and timings.

        Once the trainer starts, the step runs to its end (train, publish, save) even when the
        caller is cancelled, and the cancellation lands after it: the trainer's weights and the
        published version never disagree, so a cancelled run can save the steps it trained."""
        self._timings = {}
        if self.engine.blocks_training:
            try:
                await self._stand_down()
            except BaseException:
                await self._wake(check=False)  # resumes the clock and reopens the gate
                raise
            with anyio.CancelScope(shield=True):
                completed = False
                try:
                    result = await self._timed("train", train)
                    self.engine_version += 1
                    if save is not None:
                        await self._timed("save", save)
                    completed = True
                finally:
                    # After a failed step the trainer published nothing new: checking the
                    # weights would only hide the step's own error behind a mismatch.
                    await self._wake(check=completed)
        else:
            with anyio.CancelScope(shield=True):
                result = await self._timed("train", train)
                await self._timed("refit", self.engine.refit)
                self._check_weights("refit", self.engine_version + 1)
                # Only now does the engine serve the new weights; calls starting during the
                # refit are tagged with the old version (conservative for the lag bound).
                self.engine_version += 1
                if save is not None:
                    await self._timed("save", save)
        self._steps += 1
        return result, dict(self._timings)

    async def _stand_down(self) -> None:
        self._set_state(GateState.STANDING_DOWN)
        self.clock.suspend()
        start = self._down_since = self.clock.source.now()
        while self._in_flight and not self.partial:  # a partial engine freezes them instead
            await self._wait_changed()
        await self.engine.stand_down()
        memory = self._memory_after_stand_down = self.engine.memory_in_use()
        if self.checks is not None and memory:
            raise HandoffMismatch(f"the engine still holds {memory} bytes after standing down (expected 0)")
        self._record("stand_down", start)
        self._set_state(GateState.DOWN)

    async def _wake(self, *, check: bool) -> None:
        self._set_state(GateState.WAKING)
        try:
            if not self.engine.wake_carries_weights:
                await self._timed("refit", self.engine.refit)
            await self._timed("wake", self.engine.wake)
            if self.partial:
                wakes = self.engine.wakes  # type: ignore[attr-defined]
                self._versions[wakes] = self.engine_version
                self._windows[wakes] = (self._down_since, self.clock.source.now())
            if check:
                self._check_weights("wake", self.engine_version)
        finally:
            self.clock.resume()
            self._set_state(GateState.SERVING)

    def _check_weights(self, after: str, version: int) -> None:
        if self.checks is None:
            return
        expected, served = self.checks.fingerprint(), self.engine.fingerprint()
        if expected is None or served is None:
            return
        differ = [name for name, value in expected.items() if served.get(name) != value]
        differ += [name for name in served if name not in expected]
        if differ:
            more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
            raise HandoffMismatch(
                f"after the {after} to version {version} the engine serves weights other "
                f"than the trainer's: {differ[0]}{more} differs; its copy is stale or corrupted"
            )

    async def _timed(self, name: str, fn: Callable[[], Awaitable[T]]) -> T:
        start = self.clock.source.now()
        try:
            return await fn()
        finally:
            self._record(name, start)

    def _record(self, name: str, start: float) -> None:
        end = self.clock.source.now()
        self._timings[name] = end - start
        if self._on_transition is not None:
            self._on_transition(name, start, end)

    def _set_state(self, state: GateState) -> None:
        self._state = state
        self._notify()

    async def _wait_changed(self) -> None:
        await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def statistics(self) -> GateStatistics:
        return GateStatistics(
            state=self._state.value,
            engine_version=self.engine_version,
            in_flight=self._in_flight,
            waiting=self._waiting,
            steps=self._steps,
            last_timings=dict(self._timings),
            engine_memory_after_stand_down=self._memory_after_stand_down,
        )


class _Serving:
    """`EngineGate.serving()`: waits while the gate is not serving, then counts the call in
    flight until it exits (a class, not a generator: every turn of an episode enters one)."""

    __slots__ = ("gate",)

    def __init__(self, gate: EngineGate) -> None:
        self.gate = gate

    async def __aenter__(self) -> int:
        gate = self.gate
        gate._waiting += 1
        try:
            while gate._state is not GateState.SERVING:
                await gate._wait_changed()
        finally:
            gate._waiting -= 1
        gate._in_flight += 1
        return gate.engine_version

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        gate = self.gate
        gate._in_flight -= 1
        if gate._state is GateState.STANDING_DOWN:  # a stand-down waits for the calls in flight
            gate._notify()
