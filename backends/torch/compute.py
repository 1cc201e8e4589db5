"""A dedicated thread for a backend's torch work.

OpenMP gives every thread that calls into torch its own team of worker threads. Spread over
anyio's worker pool, a train step on one pool thread and the next generation on another kept
several teams alive on the same cores: on 2 CPU cores the reverse-digits train step took 72 ms
instead of 46 once reward scoring ran 8 groups at once (and so used 8 pool threads). A
`ComputeThread` runs every call it is given on the same thread. Colocated, the engine and the
trainer share one (they never run at once); separate, each has its own, so generation keeps
running while the trainer works.

`run` behaves like `anyio.to_thread.run_sync` without abandoning: a cancelled caller waits
for the call to finish, then sees the cancellation; `submit` starts a call without waiting;
`call` runs one from another thread and waits.
asyncio event loops only (uvloop too).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import anyio

T = TypeVar("T")


class ComputeThread:
    def __init__(self, name: str = "torch-compute") -> None:
        self.name = name
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        future = asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))
        with anyio.CancelScope(shield=True):
            result = await future
        await anyio.lowlevel.checkpoint_if_cancelled()
        return result

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Queue ``fn(*args)`` behind the calls before it and return its future at once, for
        work that outlives any one caller (the engine's decode loop): whoever submits it owns
        the future and its exception."""
        return asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the compute thread, waited for; from a thread other than the event
        loop's (a checkpoint's snapshot, taken on a worker thread)."""
        return self._executor.submit(fn, *args).result()

    def close(self) -> None:
        self._executor.shutdown(wait=False)
