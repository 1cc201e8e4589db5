"""Where reward functions run: off the pipeline's event loop, on threads a deadline can abandon.

- `run_abandonable(fn, *args)` calls a plain function on a new daemon thread. Cancelling the
  awaiting task (a `reward_s` deadline, a stop) returns at once; the thread is left to finish
  on its own, and being a daemon it never keeps the process alive at exit. (anyio's worker
  threads can be abandoned too, but the interpreter waits for them at exit: a reward that
  sleeps forever kept a finished run's process alive.)
- `run_async(fn, *args)` runs a coroutine function on the reward loop: one private event
  loop on a daemon thread, shared by every pipeline in the process, so an `async def` reward
  that blocks (a synchronous HTTP call, a `time.sleep`) cannot freeze the pipeline's loop,
  its signal handling, watchdog or deadlines. Each synchronous slice of the coroutine is
  timed; one longer than `BLOCKING_S` is reported, and a deadline that fires while a slice
  is still running says so (`blocking_note`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import types
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel

from pipeline.clock import MonotonicTime
from pipeline.logs import warn_once

log = logging.getLogger("pipeline.rewards")

T = TypeVar("T")
BLOCKING_S = 1.0  # a coroutine slice this long has blocked its loop
_now = MonotonicTime().now


async def run_abandonable(fn: Callable[..., T], *args: Any) -> T:
    token = anyio.lowlevel.current_token()
    done = anyio.Event()
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as error:  # handed to the awaiting task, which decides
            outcome["error"] = error
        try:
            anyio.from_thread.run_sync(done.set, token=token)
        except RuntimeError:  # the loop has closed: nobody waits any more
            pass

    threading.Thread(target=target, name=f"reward {getattr(fn, '__name__', fn)}", daemon=True).start()
    await done.wait()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class _RewardLoop:
    """The private event loop for `async def` rewards; started on first use, never closed."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self.slice_started: float | None = None  # when the running slice began, if one runs

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="reward loop", daemon=True).start()
            return self._loop

    def blocked_for(self) -> float | None:
        """Seconds the running coroutine slice has held the reward loop, if one is running."""
        started = self.slice_started
        return None if started is None else _now() - started

    @types.coroutine
    def timed(self, coro: Coroutine[Any, Any, T], name: str) -> Generator[Any, Any, T]:
        """Drive `coro`, timing each synchronous slice (between two awaits)."""
        value: Any = None
        error: BaseException | None = None
        while True:
            self.slice_started = start = _now()
            try:
                yielded = coro.throw(error) if error is not None else coro.send(value)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            finally:
                self.slice_started = None
                took = _now() - start
                if took > BLOCKING_S:
                    warn_once(
                        log,
                        f"blocking {name}",
                        "async reward function %s blocked its event loop for %.1f s in one step: make it "
                        "a plain def (it then runs in a worker thread) or await its slow work",
                        name,
                        took,
                    )
            try:
                value, error = (yield yielded), None
            except BaseException as thrown:  # cancellation and errors go into the coroutine
                value, error = None, thrown


_REWARD_LOOP = _RewardLoop()


async def run_async(fn: Callable[..., Awaitable[T]], *args: Any, name: str) -> T:
    """`await fn(*args)` on the reward loop; `name` is what a blocking report calls it."""

    async def body() -> T:
        return await _REWARD_LOOP.timed(fn(*args), name)  # type: ignore[arg-type]

    future = asyncio.run_coroutine_threadsafe(body(), _REWARD_LOOP.loop())
    return await asyncio.wrap_future(future)


def blocking_note() -> str:
    """For a reward timeout: whether an async reward is holding its loop right now."""
    held = _REWARD_LOOP.blocked_for()
    if held is None or held <= BLOCKING_S:
        return ""
    return (
        f"; an async reward function has blocked its event loop for {held:.1f} s (make it a plain "
        "def or await its slow work)"
    )
