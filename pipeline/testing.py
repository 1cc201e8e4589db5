"""Fakes for testing stages and pipelines without models, GPUs or real time.

- `FakeTime`: a virtual time source. `advance(dt)` moves it by hand; `autojump()` (run as a
  task) jumps to the next sleeper whenever every other task is blocked, like trio's MockClock,
  so tests with minutes of timeouts finish instantly and never sleep.
- `FakeEngine`: the `Engine` protocol with programmable latency (on the pipeline clock's time
  source), non-finite logprobs, crashes and configurable capabilities.
- `FakeTrainer`: the `Trainer` protocol; records the groups it trained and can be slowed down.
- `FaultInjector`: raises at a given stage and step.
- `FakeDynamicEngine`: the methods of megatron-core's `DynamicInferenceEngine` that
  `backends.megatron.inference.MegatronInference` drives (add_request, step_modern,
  has_unfinished_requests, get_request, suspend, resume), from a thread, without megatron or a GPU.

Every fake appends to an `events` list (shared if you pass one) so tests can assert exact order.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread

from pipeline.contracts.errors import DamagedState, NonFiniteState, RequestRejected, RetryableEngineError
from pipeline.contracts.messages import Completion, TrainGroup


class FakeTime:
    """Virtual monotonic time for `DeadlineClock(source=FakeTime())`."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._sleepers: list[tuple[float, int, anyio.Event]] = []
        self._cancelled: set[int] = set()
        self._seq = itertools.count()
        self._new_sleeper = anyio.Event()
        self._threads = 0  # `anyio.to_thread.run_sync` calls awaited now, while `autojump` runs
        self._threads_idle = anyio.Event()

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
        """Jump to the next wakeup whenever all other tasks are blocked. Runs until cancelled.

        A task awaiting `anyio.to_thread.run_sync` (a snapshot, the wait for a checkpoint's
        write, start-up) counts as working, not blocked: time stands still until the thread's
        work is done, so how long it takes on the wall clock (a loaded machine) cannot change
        what the fake clock shows. Work on threads of their own (rewards, which deadlines may
        abandon) is not waited for."""
        _JUMPING.append(self)
        if len(_JUMPING) == 1:
            anyio.to_thread.run_sync = _counted  # type: ignore[assignment]
        try:
            await self._autojump()
        finally:
            _JUMPING.remove(self)
            if not _JUMPING:
                anyio.to_thread.run_sync = _RUN_SYNC  # type: ignore[assignment]

    def _thread_done(self) -> None:
        self._threads -= 1
        if not self._threads:
            self._threads_idle.set()
            self._threads_idle = anyio.Event()

    async def _autojump(self) -> None:
        while True:
            await anyio.wait_all_tasks_blocked()
            if self._threads:
                await self._threads_idle.wait()
                continue
            wakeup = self._next_wakeup()
            if wakeup is None:
                self._new_sleeper = anyio.Event()
                await self._new_sleeper.wait()
                continue
            self.advance(max(0.0, wakeup - self._now))


_RUN_SYNC = anyio.to_thread.run_sync
_JUMPING: list[FakeTime] = []  # the fake times whose `autojump` runs: each counts thread calls


async def _counted(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`anyio.to_thread.run_sync`, counted by every running `FakeTime.autojump` while it runs."""
    counting = list(_JUMPING)
    for fake in counting:
        fake._threads += 1
    try:
        return await _RUN_SYNC(fn, *args, **kwargs)
    finally:
        for fake in counting:
            fake._thread_done()


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

    `partial_rollouts=True`: a call makes its tokens one at a time, `latency / response_len`
    apart, and a stand-down freezes it at its next token until the wake (each stretch tagged
    with `wakes` in `Completion.segments`); a token's logprob is -1 - (wakes when generated).
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
        partial_rollouts: bool = False,
    ) -> None:
        self.partial_rollouts = partial_rollouts
        self.wakes = 0
        self.frozen = 0  # calls frozen at a stand-down, in all
        self._woken = anyio.Event()
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
        self, prompt_tokens: Sequence[int], n: int, *, greedy: bool = False, episode: str | None = None
    ) -> list[Completion]:
        call = self.calls
        self.calls += 1
        if self.down:
            raise AssertionError("FakeEngine.generate called while stood down")
        latency = self.latency(call) if callable(self.latency) else self.latency
        if self.partial_rollouts:
            return await self._generate_partial(prompt_tokens, n, latency)
        if latency:
            await self._sleep(latency)
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

    async def _sleep(self, seconds: float) -> None:
        await (self.time.sleep(seconds) if self.time is not None else anyio.sleep(seconds))

    async def _generate_partial(
        self, prompt_tokens: Sequence[int], n: int, latency: float
    ) -> list[Completion]:
        first = prompt_tokens[0] if prompt_tokens else 0
        logprobs: list[float] = []
        segments: list[tuple[int, int]] = []
        for index in range(self.response_len):
            if self.down:
                self.frozen += 1
                await self._woken.wait()
            if latency:
                await self._sleep(latency / self.response_len)
            if not segments or segments[-1][1] != self.wakes:
                segments.append((index, self.wakes))
            logprobs.append(-1.0 - self.wakes)
        return [
            Completion(
                tokens=tuple(first + i for _ in range(self.response_len)),
                logprobs=tuple(logprobs),
                finish_reason="length",
                segments=tuple(segments),
                reprefilled_tokens=sum(len(prompt_tokens) + start for start, _ in segments[1:]),
            )
            for i in range(n)
        ]

    async def stand_down(self) -> None:
        self.events.append("stand_down")
        await anyio.lowlevel.checkpoint()  # a real engine's handoff calls yield to the loop
        self.down = True

    async def wake(self) -> None:
        self.events.append("wake")
        await anyio.lowlevel.checkpoint()
        self.down = False
        self.wakes += 1
        self._woken.set()
        self._woken = anyio.Event()

    async def refit(self) -> None:
        self.events.append("refit")
        await anyio.lowlevel.checkpoint()
        self.version += 1

    def memory_in_use(self) -> int | None:
        return self.held_when_down if self.down else None

    def save(self, directory: Path) -> None:
        """No state of its own: checkpoints hold nothing of it."""

    def load(self, directory: Path) -> None:
        pass

    def close(self) -> None:
        pass

    def fingerprint(self) -> Mapping[str, int] | None:
        return self.served


class FakeTrainer:
    """Records every train step; `latency` slows it down on the given time source;
    `skipped_steps` (step indices, from 0) report a non-finite loss and no applied update;
    from `nonfinite_state_from` steps on, its state holds a NaN (weights gone bad: `save`
    raises `NonFiniteState`). Checkpoints hold its step count in `trainer.json`."""

    FILE = "trainer.json"

    def __init__(
        self,
        *,
        time: Any = None,
        latency: float = 0.0,
        events: list[str] | None = None,
        on_step: Callable[[int, Sequence[TrainGroup]], None] | None = None,
        skipped_steps: Sequence[int] = (),
        nonfinite_state_from: int | None = None,
    ) -> None:
        self.time = time
        self.latency = latency
        self.skipped_steps = set(skipped_steps)
        self.nonfinite_state_from = nonfinite_state_from
        self.events = events if events is not None else []
        self.on_step = on_step
        self.steps: list[list[TrainGroup]] = []
        self.published: dict[str, int] | None = None  # what `fingerprint()` returns

    async def train_step(self, groups: Sequence[TrainGroup]) -> Mapping[str, float]:
        self.events.append("train")
        if self.latency:
            await (self.time.sleep(self.latency) if self.time is not None else anyio.sleep(self.latency))
        if self.on_step is not None:
            self.on_step(len(self.steps), groups)
        skipped = len(self.steps) in self.skipped_steps
        self.steps.append(list(groups))
        if skipped:
            return {"train/loss": math.nan, "train/applied_updates": 0.0}
        return {"train/loss": 0.0, "train/grad_norm": 0.0, "train/applied_updates": 1.0}

    @property
    def completed_steps(self) -> int:
        return len(self.steps)

    def save(self, directory: Path) -> None:
        bad = self.nonfinite_state_from is not None and len(self.steps) >= self.nonfinite_state_from
        if bad:
            raise NonFiniteState(f"{self.FILE} would hold non-finite values at scale")
        (directory / self.FILE).write_text(json.dumps({"steps": len(self.steps), "scale": 1.0}))

    def load(self, directory: Path) -> None:
        """Restores the number of steps (as empty ones); `DamagedState` for a file missing, not
        JSON, or with a non-finite `scale`."""
        try:
            state = json.loads((directory / self.FILE).read_text())
        except FileNotFoundError:
            raise DamagedState(f"{self.FILE} is missing") from None
        except (OSError, ValueError) as error:
            raise DamagedState(f"{self.FILE} does not load: {type(error).__name__}: {error}") from None
        if not math.isfinite(state["scale"]):
            raise DamagedState(f"{self.FILE} holds non-finite values at scale")
        self.steps = [[] for _ in range(int(state["steps"]))]

    def close(self) -> None:
        pass

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


class _FakeRequest:
    """A request of `FakeDynamicEngine`, and the record `step_modern` reports finished: its
    `requests` are megatron's record's, one per recompute checkpoint, each holding the tokens
    generated since the last. As megatron's, a record's `generated_log_probs` is None until its
    first token (megatron makes the list then), so a record frozen before any token has none."""

    def __init__(self, request_id: int, prompt: list[int], length: int) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.length = length
        self.generated_tokens: list[int] = []
        self.generated_log_probs: list[float] = []
        self.cuts: list[int] = []  # tokens so far at each recompute checkpoint

    @property
    def requests(self) -> list[SimpleNamespace]:
        bounds = [0, *self.cuts, len(self.generated_tokens)]
        return [
            SimpleNamespace(
                request_id=self.request_id,
                generated_tokens=self.generated_tokens[start:end],
                generated_log_probs=self.generated_log_probs[start:end] or None,
            )
            for start, end in itertools.pairwise(bounds)
        ]

    def latest(self) -> SimpleNamespace:
        """Its latest record, as megatron's `get_request` returns it: after a recompute
        checkpoint the tokens before it are part of the prompt."""
        cut = self.cuts[-1] if self.cuts else 0
        return SimpleNamespace(
            prompt_tokens=self.prompt + self.generated_tokens[:cut],
            generated_tokens=self.generated_tokens[cut:],
        )


class FakeDynamicEngine:
    """A dynamic inference engine whose requests generate `length` tokens (fewer where their
    sampling parameters' `num_tokens_to_generate` says so, as megatron's `SamplingParams`), one
    a step: token k of a request is (last prompt token + k + 1) % `vocab` with logprob
    -0.5 - `weights` (a test sets `weights` to stand for the model's weights version), and a
    token in `stop_at` ends it early. Events: `add <id>`, `step`, `suspend`, `resume`, and
    `recompute <id>` for each request a recompute resume adds again.

    Like megatron's, it keeps requests in flight across suspend/resume; stepping while
    suspended, or adding a request then, raises (the adapter must not). `recompute=True` is
    megatron's recompute mode: `suspend()` checkpoints each request in flight (`get_request`
    then shows its tokens so far in its prompt) and `resume()` adds it again. `hold_after_steps`
    makes `has_unfinished_requests()` say no past that many steps until `release()`, so a test
    can stand the engine down between two steps; `wait_steps(k)` blocks until k steps ran.
    `fail_at_step` raises `InjectedFault` in that step (from 1).
    """

    def __init__(
        self,
        *,
        length: int = 3,
        vocab: int = 16,
        stop_at: Sequence[int] = (),
        hold_after_steps: int | None = None,
        fail_at_step: int | None = None,
        recompute: bool = False,
    ) -> None:
        self.recompute = recompute
        self.weights = 0
        self.length = length
        self.vocab = vocab
        self.stop_at = set(stop_at)
        self.hold_after_steps = hold_after_steps
        self.fail_at_step = fail_at_step
        self.events: list[str] = []
        self.sampling: list[Any] = []  # the sampling parameters each request was added with
        self.suspended = False
        self.steps = 0
        self._active: list[_FakeRequest] = []
        self._progress = threading.Condition()

    def add_request(self, request_id: int, prompt: list[int], sampling_params: Any) -> None:
        if self.suspended:
            raise AssertionError("request added to a suspended engine")
        self.events.append(f"add {request_id}")
        self.sampling.append(sampling_params)
        limit = getattr(sampling_params, "num_tokens_to_generate", None) or self.length
        self._active.append(_FakeRequest(request_id, prompt, min(self.length, limit)))

    def get_request(self, request_id: int) -> SimpleNamespace:
        (request,) = [r for r in self._active if r.request_id == request_id]
        return request.latest()

    def has_unfinished_requests(self) -> bool:
        held = self.hold_after_steps is not None and self.steps >= self.hold_after_steps
        return bool(self._active) and not held

    def release(self) -> None:
        self.hold_after_steps = None

    def step_modern(self) -> dict[str, Any]:
        if self.suspended:
            raise AssertionError("stepped while suspended")
        self.events.append("step")
        if self.fail_at_step is not None and self.steps + 1 == self.fail_at_step:
            raise InjectedFault(f"injected fault in engine step {self.fail_at_step}")
        finished = []
        for request in self._active:
            token = (request.prompt[-1] + len(request.generated_tokens) + 1) % self.vocab
            request.generated_tokens.append(token)
            request.generated_log_probs.append(-0.5 - self.weights)
            if len(request.generated_tokens) == request.length or token in self.stop_at:
                finished.append(request)
        self._active = [r for r in self._active if r not in finished]
        with self._progress:
            self.steps += 1
            self._progress.notify_all()
        return {"finished_request_records": finished}

    def suspend(self) -> None:
        self.events.append("suspend")
        self.suspended = True
        if self.recompute:
            for request in self._active:
                request.cuts.append(len(request.generated_tokens))

    def resume(self) -> None:
        self.events.append("resume")
        self.suspended = False
        if self.recompute:
            self.events.extend(f"recompute {r.request_id}" for r in self._active)

    def wait_steps(self, steps: int, timeout: float = 30.0) -> None:
        with self._progress:
            if not self._progress.wait_for(lambda: self.steps >= steps, timeout):
                raise TimeoutError(f"the engine made {self.steps} of {steps} steps")
