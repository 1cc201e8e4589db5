"""Fakes for testing stages and pipelines without models, GPUs or real time.

- `FakeTime`: a virtual time source. `advance(dt)` moves it by hand; `autojump()` (run as a
  task) jumps to the next sleeper whenever every other task is blocked, like trio's MockClock,
  so tests with minutes of timeouts finish instantly and never sleep.
- `FakeEngine`: the `Engine` protocol with programmable latency (on the pipeline clock's time
  source), non-finite logprobs, crashes and configurable capabilities.
- `FakeTrainer`: the `Trainer` protocol; records what it trained and can be slowed down.
- `FaultInjector`: raises at a given stage and step.

Every fake appends to an `events` list (shared if you pass one) so tests can assert exact order.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio

from pipeline.errors import RequestRejected, RetryableEngineError
from pipeline.messages import Completion, Sample


class FakeTime:
    """Virtual monotonic time for `DeadlineClock(source=FakeTime())`."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._sleepers: list[tuple[float, int, anyio.Event]] = []
        self._cancelled: set[int] = set()
        self._seq = itertools.count()
        self._new_sleeper = anyio.Event()

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await anyio.lowlevel.checkpoint()
            return
        event = anyio.Event()
        seq = next(self._seq)
        heapq.heappush(self._sleepers, (self._now + seconds, seq, event))
        self._new_sleeper.set()
        try:
            await event.wait()
        finally:
            if not event.is_set():
                self._cancelled.add(seq)

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every sleeper whose time has come."""
        self._now += seconds
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _, seq, event = heapq.heappop(self._sleepers)
            self._cancelled.discard(seq)
            event.set()

    def _next_wakeup(self) -> float | None:
        while self._sleepers and self._sleepers[0][1] in self._cancelled:
            self._cancelled.discard(heapq.heappop(self._sleepers)[1])
        return self._sleepers[0][0] if self._sleepers else None

    async def autojump(self) -> None:
        """Jump to the next wakeup whenever all other tasks are blocked. Runs until cancelled."""
        while True:
            await anyio.wait_all_tasks_blocked()
            wakeup = self._next_wakeup()
            if wakeup is None:
                self._new_sleeper = anyio.Event()
                await self._new_sleeper.wait()
                continue
            self.advance(max(0.0, wakeup - self._now))


class EngineCrash(RetryableEngineError):
    """What `FakeEngine` raises when told to crash."""


class FakeEngine:
    """A generation engine with programmable behaviour.

    Each completion has `response_len` tokens, each token `prompt_tokens[0] + sample index`,
    with logprob -1.0. `latency` (seconds, or a function of the call number) is slept on the
    given time source; `nonfinite_calls` returns NaN logprobs on those call numbers;
    `crash_calls` raises `EngineCrash` (an infrastructure failure, retried) on those call numbers;
    `reject_calls` raises `RequestRejected` on those call numbers; `errors` maps a call number to
    the exception it raises (a `RuntimeError`, say: a bug in the engine); the first greedy calls
    (the evaluation's) raise `greedy_errors`, one each, in order. `fingerprint()` returns
    `served` (None: no handoff check); `memory_in_use()` returns `held_when_down` while stood down.
    """

    def __init__(
        self,
        *,
        time: Any = None,
        latency: float | Callable[[int], float] = 0.0,
        blocks_training: bool = True,
        wake_carries_weights: bool = True,
        response_len: int = 4,
        nonfinite_calls: Sequence[int] = (),
        crash_calls: Sequence[int] = (),
        reject_calls: Sequence[int] = (),
        errors: Mapping[int, Exception] | None = None,
        greedy_errors: Sequence[Exception] = (),
        events: list[str] | None = None,
    ) -> None:
        self.time = time
        self.latency = latency
        self.blocks_training = blocks_training
        self.wake_carries_weights = wake_carries_weights
        self.response_len = response_len
        self.nonfinite_calls = set(nonfinite_calls)
        self.crash_calls = set(crash_calls)
        self.reject_calls = set(reject_calls)
        self.errors = dict(errors or {})
        self.greedy_errors = list(greedy_errors)
        self.events = events if events is not None else []
        self.calls = 0
        self.down = False
        self.version = 0
        self.served: dict[str, int] | None = None
        self.held_when_down = 0

    async def generate(
        self, prompt_tokens: Sequence[int], n: int, *, greedy: bool = False
    ) -> list[Completion]:
        call = self.calls
        self.calls += 1
        if self.down:
            raise AssertionError("FakeEngine.generate called while stood down")
        latency = self.latency(call) if callable(self.latency) else self.latency
        if latency:
            await (self.time.sleep(latency) if self.time is not None else anyio.sleep(latency))
        if call in self.crash_calls:
            raise EngineCrash(f"fake engine crashed on call {call}")
        if call in self.reject_calls:
            raise RequestRejected(f"fake engine rejected call {call}")
        if call in self.errors:
            raise self.errors[call]
        if greedy and self.greedy_errors:
            raise self.greedy_errors.pop(0)
        logprob = math.nan if call in self.nonfinite_calls else -1.0
        first = prompt_tokens[0] if prompt_tokens else 0
        return [
            Completion(
                tokens=tuple(first + i for _ in range(self.response_len)),
                logprobs=tuple(logprob for _ in range(self.response_len)),
                finish_reason="length",
            )
            for i in range(n)
        ]

    async def stand_down(self) -> None:
        self.events.append("stand_down")
        self.down = True

    async def wake(self) -> None:
        self.events.append("wake")
        self.down = False

    async def refit(self) -> None:
        self.events.append("refit")
        self.version += 1

    def memory_in_use(self) -> int | None:
        return self.held_when_down if self.down else None

    def fingerprint(self) -> Mapping[str, int] | None:
        return self.served


class FakeTrainer:
    """Records every train step; `latency` slows it down on the given time source;
    `skipped_steps` (step indices, from 0) report a non-finite loss and no applied update;
    from `nonfinite_state_from` steps on, `state()` holds a NaN (weights gone bad)."""

    def __init__(
        self,
        *,
        time: Any = None,
        latency: float = 0.0,
        events: list[str] | None = None,
        on_step: Callable[[int, Sequence[Sample]], None] | None = None,
        skipped_steps: Sequence[int] = (),
        nonfinite_state_from: int | None = None,
    ) -> None:
        self.time = time
        self.latency = latency
        self.skipped_steps = set(skipped_steps)
        self.nonfinite_state_from = nonfinite_state_from
        self.events = events if events is not None else []
        self.on_step = on_step
        self.steps: list[list[Sample]] = []
        self.published: dict[str, int] | None = None  # what `fingerprint()` returns

    async def train_step(self, samples: Sequence[Sample], advantages: Sequence[float]) -> Mapping[str, float]:
        self.events.append("train")
        if self.latency:
            await (self.time.sleep(self.latency) if self.time is not None else anyio.sleep(self.latency))
        if self.on_step is not None:
            self.on_step(len(self.steps), samples)
        skipped = len(self.steps) in self.skipped_steps
        self.steps.append(list(samples))
        if skipped:
            return {"train/loss": math.nan, "train/applied_updates": 0.0}
        return {"train/loss": 0.0, "train/grad_norm": 0.0, "train/applied_updates": 1.0}

    def state(self) -> Mapping[str, Any]:
        bad = self.nonfinite_state_from is not None and len(self.steps) >= self.nonfinite_state_from
        return {"steps": len(self.steps), "scale": math.nan if bad else 1.0}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.steps = [[] for _ in range(int(state["steps"]))]

    def fingerprint(self) -> Mapping[str, int] | None:
        return self.published


class InjectedFault(RuntimeError):
    """What `FaultInjector` raises."""


class FaultInjector:
    """`check(stage, step)` raises `InjectedFault` once at the configured stage and step."""

    def __init__(self, stage: str, step: int) -> None:
        self.stage = stage
        self.step = step
        self.fired = False

    def check(self, stage: str, step: int) -> None:
        if not self.fired and stage == self.stage and step == self.step:
            self.fired = True
            raise InjectedFault(f"injected fault in stage {stage!r} at step {step}")
