"""megatron-core's dynamic inference engine behind the pipeline's `Engine` protocol.

`MegatronInference` drives a `DynamicInferenceEngine` that shares the trainer's module (same
process, same GPUs): `blocks_training` and `wake_carries_weights` are both true, so the gate
stands it down for every train step and the wake serves the new weights with no copy.

The engine is not thread-safe and its `step_modern()` blocks, so one thread of its own owns it
for its whole life. The event loop talks to that thread through a command queue; each command
carries a future of the caller's loop that the thread settles with `call_soon_threadsafe`:

    generate   -> ("add", ...)      n requests of one prompt; settled when all n finish
    stand_down -> ("suspend", ...)  `engine.suspend()`: KV cache released, requests in flight
                                    kept (recomputed or restored at resume, as the engine's
                                    `kv_cache_management_mode` says)
    wake       -> ("resume", ...)   `engine.resume()`: memory back, frozen requests re-added
    close      -> ("close", None)   the thread ends (requests still pending fail)

States: serving -> suspending -> down -> resuming -> serving; closed at the end. The thread
steps the engine only while serving and holding unfinished requests, and otherwise blocks on
the queue. Requests added while down wait in the adapter and enter the engine at resume. An
exception in the thread fails every pending and later call with it (a bug, not retried).

Nothing here imports megatron: the engine and its sampling parameters are given
(`sampling(greedy)` builds them), so the state machine runs against
`pipeline.testing.FakeDynamicEngine` on any machine.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

from pipeline.messages import Completion


class State(Enum):
    SERVING = "serving"
    SUSPENDING = "suspending"
    DOWN = "down"
    RESUMING = "resuming"
    CLOSED = "closed"


class _Pending:
    """One `generate` call: its requests' ids, their completions so far, the caller's future."""

    def __init__(self, ids: list[int], future: asyncio.Future[list[Completion]]) -> None:
        self.ids = ids
        self.done: dict[int, Completion] = {}
        self.future = future


def _settle(future: asyncio.Future[Any], value: Any, error: BaseException | None = None) -> None:
    """Resolve `future` on its own loop from the engine thread (a cancelled caller is gone)."""

    def settle() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    future.get_loop().call_soon_threadsafe(settle)


class MegatronInference:
    blocks_training = True
    wake_carries_weights = True

    def __init__(
        self,
        engine: Any,
        *,
        sampling: Callable[[bool], Any],
        stop_token_ids: Sequence[int],
        memory_in_use: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.engine = engine
        self.sampling = sampling
        self.stop_token_ids = frozenset(stop_token_ids)
        self._memory = memory_in_use
        self.state = State.SERVING
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._ids = itertools.count()
        self._pending: dict[int, _Pending] = {}  # by request id
        self._held: list[tuple[list[int], Sequence[int], bool]] = []  # added while down
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="megatron-inference", daemon=True)
        self._thread.start()

    async def _call(self, command: str, payload: Any = None) -> Any:
        if self._failure is not None:
            raise self._failure
        if self.state is State.CLOSED:
            raise RuntimeError("the megatron inference engine is closed")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._commands.put((command, (future, payload)))
        return await future

    async def generate(
        self, prompt_tokens: Sequence[int], n: int, *, greedy: bool = False
    ) -> list[Completion]:
        return await self._call("add", (list(prompt_tokens), n, greedy))

    async def stand_down(self) -> None:
        await self._call("suspend")

    async def wake(self) -> None:
        await self._call("resume")

    async def refit(self) -> None:
        """Nothing to copy: the engine serves the trainer's own module."""

    def fingerprint(self) -> None:
        return None

    def memory_in_use(self) -> int | None:
        return self._memory()

    def close(self) -> None:
        """End the engine thread after its current step (closing twice is harmless)."""
        if self._thread.is_alive():
            self._commands.put(("close", None))
            self._thread.join()

    # The engine thread.

    def _run(self) -> None:
        try:
            while True:
                stepping = self.state is State.SERVING and self.engine.has_unfinished_requests()
                try:
                    command, payload = self._commands.get(block=not stepping)
                except queue.Empty:
                    self._step()
                    continue
                if command == "close":
                    break
                self._handle(command, *payload)
        except Exception as error:  # a bug: every caller gets it (with its traceback), once each
            self._failure = error
        finally:
            self.state = State.CLOSED
            failure = self._failure or RuntimeError("the megatron inference engine closed")
            for pending in {id(p): p for p in self._pending.values()}.values():
                _settle(pending.future, None, failure)
            while not self._commands.empty():
                command, payload = self._commands.get()
                if payload is not None:
                    _settle(payload[0], None, failure)

    def _handle(self, command: str, future: asyncio.Future[Any], payload: Any) -> None:
        if command == "add":
            prompt, n, greedy = payload
            ids = [next(self._ids) for _ in range(n)]
            pending = _Pending(ids, future)
            self._pending.update(dict.fromkeys(ids, pending))
            if self.state is State.DOWN:
                self._held.append((ids, prompt, greedy))
            else:
                self._add(ids, prompt, greedy)
            return
        if command == "suspend":
            if self.state is State.SERVING:
                self.state = State.SUSPENDING
                self.engine.suspend()
                self.state = State.DOWN
        elif command == "resume":
            if self.state is State.DOWN:
                self.state = State.RESUMING
                self.engine.resume()
                held, self._held = self._held, []
                for ids, prompt, greedy in held:
                    self._add(ids, prompt, greedy)
                self.state = State.SERVING
        else:
            raise AssertionError(f"unknown command {command!r}")
        _settle(future, None)

    def _add(self, ids: list[int], prompt: Sequence[int], greedy: bool) -> None:
        for request_id in ids:
            self.engine.add_request(request_id, list(prompt), self.sampling(greedy))

    def _step(self) -> None:
        result = self.engine.step_modern()
        for record in result["finished_request_records"]:
            request = record.merge()
            pending = self._pending.pop(request.request_id)
            tokens = tuple(request.generated_tokens)
            stopped = bool(tokens) and tokens[-1] in self.stop_token_ids
            pending.done[request.request_id] = Completion(
                tokens=tokens,
                logprobs=tuple(request.generated_log_probs),
                finish_reason="stop" if stopped else "length",
            )
            if len(pending.done) == len(pending.ids):
                _settle(pending.future, [pending.done[i] for i in pending.ids])
