"""megatron-core's dynamic inference engine behind the pipeline's `Engine` protocol.

`MegatronInference` drives a `DynamicInferenceEngine`. Colocated it shares the trainer's module
(same process, same GPUs): `blocks_training` and `wake_carries_weights` are both true, so the
gate stands it down for every train step and the wake serves the new weights with no copy.
Apart (`refresh_weights` given: the engine serves a model of its own) neither is: it keeps
serving while the trainer steps, and `refit` brings its model up to date once the requests in
flight have finished, as the torch engine's refit does between two loops: requests that arrive
meanwhile wait in the adapter and enter after it, so every request is generated under one
weights version. `fingerprint` is then taken of the refreshed model (`fingerprint` given), for
the gate's handoff checks; `load` refreshes too (a resume's weights are the trainer's).
Colocated there is none (it serves the trainer's own module). A replica apart on
Ray (`weights_in` given) is sent the trainer's weights (`load_weights`, checked against
`served_parameters`) and refits with them as above.

The engine is not thread-safe and its `step_modern()` blocks, so one thread of its own owns it
for its whole life. The event loop talks to that thread through a command queue; each command
carries a future of the caller's loop that the thread settles with `call_soon_threadsafe`:

    generate   -> ("add", ...)      n requests of one prompt; settled when all n finish
    stand_down -> ("suspend", ...)  `engine.suspend()`: KV cache released, requests in flight
                                    kept (recomputed or restored at resume, as the engine's
                                    `kv_cache_management_mode` says), then `handoff.release`
    wake       -> ("resume", ...)   `handoff.restore`, then `engine.resume()`: memory back,
                                    frozen requests re-added
    refit      -> ("refit", ...)    apart: once no request is unfinished, `refresh_weights`
                                    (and the fingerprint); `load` sends it too
    close      -> ("close", None)   a serving engine is suspended, then `handoff.close`; the
                                    thread ends (requests still pending fail)

The optional `handoff` (`Handoff`) is what a graphed engine does with its cache's memory beside
megatron's own calls (`serve.KVHandoff`).

States: serving -> suspending -> down -> resuming -> serving; closed at the end. The thread
steps the engine only while serving and holding unfinished requests, and otherwise blocks on
the queue. Requests added while down (or while a refit waits) wait in the adapter and enter the
engine at resume (after the refit). An exception in the thread fails every pending and later
call with it (a bug, not retried).

Partial rollouts (``partial=True``, colocated; `PartialRollouts`): the gate stands the engine
down with requests in flight, and megatron's `suspend()` keeps them. They rely on megatron's
recompute mode (`KVCacheManagementMode.RECOMPUTE`, what `serve.inference_config` sets without
graphs): its suspend drops the KV cache and checkpoints each request in flight (its prompt
becomes prompt + tokens so far), and its resume adds them again, so each continues under the
new weights after prefilling its prompt and tokens so far again, as the torch engine continues
a frozen row. ``freeze`` runs on the engine thread just before each suspend (`serve` drops the
forward megatron's async schedule launched for the next token, whose logits are the old
weights'). Before the suspend the adapter reads each request's tokens so far from the engine
(`get_request`); at the resume it counts the wake (`wakes`) and opens a new stretch there, tagged
with that count (`Completion.segments`, as the torch engine tags them), and adds prompt plus
tokens so far to the request's `reprefilled_tokens`. A request that had generated nothing when
frozen has its one stretch retagged. Every token keeps the logprob it was drawn with.

The thread also builds the engine (`build()`, before the constructor returns, raising what it
raised): megatron's engine takes the event loop running where it is constructed for its own
`run_until_complete` in each step, so it must be built where none runs and stepped by the one
thread that owns it.

Each request gets its own sampling parameters, `sampling(greedy, limit)`: `limit` is
`max_new_tokens`, or with `lengths` (`rollout.bench_lengths`) a length drawn for it, which ends
it with finish_reason "stop" as if it had emitted end-of-sequence there (as the torch engine
does). A prompt that with its limit passes `max_sequence_length` is refused
(`RequestRejected`) before it reaches the engine, which would otherwise fail it. `save`/`load`
keep the engine's sampling RNG (`generator(engine)`) and the lengths' draw in `engine.pt`, the
torch engine's file and layout.

Nothing here imports megatron: the engine and its sampling parameters are given, so the state
machine runs against `pipeline.testing.FakeDynamicEngine` on any machine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

from backends.bench_lengths import LengthDraw
from backends.torch.state_file import ENGINE_FILE, load_state, save_state
from pipeline.contracts.errors import RequestRejected
from pipeline.contracts.messages import Completion


class Handoff(Protocol):
    """What the engine thread does beside the engine's own suspend/resume/close (the cache's
    memory of a graphed engine, `serve.KVHandoff`)."""

    def release(self, engine: Any) -> None: ...  # after engine.suspend()
    def restore(self, engine: Any) -> None: ...  # before engine.resume()
    def close(self, engine: Any) -> None: ...  # after the last engine.suspend()


class WeightsIn(Protocol):
    """Where an engine replica apart on Ray receives the trainer's weights between refits
    (`apart.ReplicaCopy`): `like`, each parameter a package must hold (name, shape, dtype);
    `receive`, the weights the next refit copies in."""

    @property
    def like(self) -> Sequence[tuple[str, Any]]: ...

    def receive(self, weights: Mapping[str, Any]) -> None: ...


class State(Enum):
    SERVING = "serving"
    SUSPENDING = "suspending"
    DOWN = "down"
    RESUMING = "resuming"
    CLOSED = "closed"


Future = asyncio.Future[Any] | concurrent.futures.Future[Any]


class _Pending:
    """One `generate` call: its requests' ids, their completions so far, the caller's future."""

    def __init__(self, ids: list[int], prompt_tokens: int, future: Future) -> None:
        self.ids = ids
        self.prompt_tokens = prompt_tokens
        self.done: dict[int, Completion] = {}
        self.future = future


class _Stretches:
    """One request's stretches (partial rollouts): (first token index, the engine's `wakes`
    then) of each, and the tokens prefilled again to continue it."""

    __slots__ = ("reprefilled", "starts")

    def __init__(self, wakes: int) -> None:
        self.starts = [(0, wakes)]
        self.reprefilled = 0

    def continue_at(self, tokens: int, wakes: int, prompt_tokens: int) -> None:
        """It was frozen with `tokens` generated; it continues after wake number `wakes`."""
        if self.starts[-1][0] == tokens:  # nothing generated since its last stretch opened
            self.starts[-1] = (tokens, wakes)
        else:
            self.starts.append((tokens, wakes))
        if tokens:  # a request frozen before its first token is prefilled for the first time
            self.reprefilled += prompt_tokens + tokens


def _settle(future: Future, value: Any, error: BaseException | None = None) -> None:
    """Resolve `future` from the engine thread: an asyncio one on its own loop (a cancelled
    caller is gone), a blocking caller's at once."""

    def settle() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    if isinstance(future, asyncio.Future):
        future.get_loop().call_soon_threadsafe(settle)
    else:
        settle()


class MegatronInference:
    def __init__(
        self,
        build: Callable[[], Any],
        *,
        sampling: Callable[[bool, int], Any],
        stop_token_ids: Sequence[int],
        max_new_tokens: int,
        max_sequence_length: int | None = None,
        lengths: LengthDraw | None = None,
        memory_in_use: Callable[[Any], int | None] = lambda engine: None,
        generator: Callable[[Any], Any] = lambda engine: None,
        serving: Callable[[], None] = lambda: None,
        handoff: Handoff | None = None,
        partial: bool = False,
        freeze: Callable[[Any], None] = lambda engine: None,
        refresh_weights: Callable[[], None] | None = None,
        fingerprint: Callable[[], Mapping[str, int] | None] = lambda: None,
        weights_in: WeightsIn | None = None,
    ) -> None:
        assert refresh_weights is None or not partial, "partial rollouts need an engine that stands down"
        self.engine: Any = None
        # Apart (a model of its own, refreshed by refit) it never stands down.
        self.blocks_training = self.wake_carries_weights = refresh_weights is None
        self.partial_rollouts = partial
        self.wakes = 0  # resumes served (tags partial rollouts' stretches)
        self._freeze = freeze
        self._refresh = refresh_weights
        self._fingerprint = fingerprint
        self._weights_in = weights_in
        self._served: Mapping[str, int] | None = None  # the fingerprint of the last refresh
        self._refit_waiting: list[Future] = []  # refits waiting for the requests in flight
        self._stretches: dict[int, _Stretches] = {}  # by request id (partial rollouts)
        self._frozen: dict[int, int] = {}  # tokens so far of each request frozen by the suspend
        self._handoff = handoff
        self._serving = serving  # on the engine thread, before it serves: once built, each resume
        self.sampling = sampling
        self.stop_token_ids = frozenset(stop_token_ids)
        self.max_new_tokens = max_new_tokens
        self.max_sequence_length = max_sequence_length
        self.lengths = lengths
        self._memory = memory_in_use
        self._generator = generator
        self.state = State.SERVING
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._ids = itertools.count()
        self._pending: dict[int, _Pending] = {}  # by request id
        self._held: list[tuple[list[int], Sequence[int], bool, list[int]]] = []  # added while down
        self._failure: BaseException | None = None
        built = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(build, built), name="megatron-inference", daemon=True
        )
        self._thread.start()
        built.wait()
        if self.engine is None:  # the build failed: the thread has ended
            assert self._failure is not None
            raise self._failure

    def _check_open(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self.state is State.CLOSED:
            raise RuntimeError("the megatron inference engine is closed")

    async def _call(self, command: str, payload: Any = None) -> Any:
        self._check_open()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._commands.put((command, (future, payload)))
        return await future

    def _call_blocking(self, command: str) -> Any:
        """`_call` from a thread that runs no event loop (a resume's `load`)."""
        self._check_open()
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put((command, (future, None)))
        return future.result()

    async def generate(
        self, prompt_tokens: Sequence[int], n: int, *, greedy: bool = False, episode: str | None = None
    ) -> list[Completion]:
        """Queue the request; ``episode`` is ignored (every turn prefills its whole prompt)."""
        limits = self.lengths.draw(n) if self.lengths is not None else [self.max_new_tokens] * n
        bound = self.max_sequence_length
        if bound is not None and len(prompt_tokens) + max(limits) > bound:
            raise RequestRejected(
                f"a prompt of {len(prompt_tokens)} tokens + {max(limits)} new tokens exceeds the "
                f"megatron engine's max sequence length {bound}"
            )
        return await self._call("add", (list(prompt_tokens), greedy, limits))

    async def stand_down(self) -> None:
        await self._call("suspend")

    async def wake(self) -> None:
        await self._call("resume")

    async def refit(self) -> None:
        """Apart: refresh the served model once the requests in flight have finished (module
        docstring). Colocated nothing to copy: the engine serves the trainer's own module."""
        if self._refresh is not None:
            await self._call("refit")

    def served_parameters(self) -> Sequence[tuple[str, Any]]:
        """A Ray replica's: the parameters `load_weights` takes (names, shapes, dtypes)."""
        assert self._weights_in is not None, "only a Ray replica is sent weights"
        return self._weights_in.like

    async def load_weights(self, weights: Mapping[str, Any]) -> None:
        """A Ray replica's refit: serve `weights` (the trainer's, by the engine `Decoder`'s
        names) once the requests in flight have finished."""
        assert self._weights_in is not None, "only a Ray replica is sent weights"
        self._weights_in.receive(weights)
        await self.refit()

    def fingerprint(self) -> Mapping[str, int] | None:
        """Of the model as the last refresh left it (None colocated, or without handoff checks)."""
        return self._served

    def memory_in_use(self) -> int | None:
        return self._memory(self.engine)

    def save(self, directory: Path) -> None:
        save_state(directory / ENGINE_FILE, self.state_dict())

    def load(self, directory: Path) -> None:
        """The sampling state; apart also the trainer's weights, loaded just before (a worker
        thread's call, before anything is generated)."""
        self.load_state_dict(load_state(directory / ENGINE_FILE))
        if self._refresh is not None:
            self._call_blocking("refit")

    def state_dict(self) -> dict[str, Any]:
        """The sampling RNG and the bench lengths' draw (read between steps: saves run while the
        engine is down)."""
        state: dict[str, Any] = {}
        generator = self._generator(self.engine)
        if generator is not None:
            state["generator"] = generator.get_state()
        if self.lengths is not None:
            state["lengths"] = self.lengths.state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        generator = self._generator(self.engine)
        if generator is not None and "generator" in state:
            generator.set_state(state["generator"])
        if self.lengths is not None and "lengths" in state:
            self.lengths.load_state(state["lengths"])

    def close(self) -> None:
        """End the engine thread after its current step, suspending a serving engine first (its
        KV cache and megatron's "inference active" flag, which the model's forward reads and
        `inference_mode` keeps per thread, are let go); closing twice is harmless."""
        if self._thread.is_alive():
            self._commands.put(("close", None))
            self._thread.join()

    # The engine thread.

    def _run(self, build: Callable[[], Any], built: threading.Event) -> None:
        try:
            self.engine = build()
            self._serving()
        except BaseException as error:  # the constructor raises it
            self._failure = error
            self.state = State.CLOSED
            return
        finally:
            built.set()
        try:
            while True:
                stepping = self.state is State.SERVING and self.engine.has_unfinished_requests()
                if self._refit_waiting and not stepping:
                    self._refit()
                    continue
                try:
                    command, payload = self._commands.get(block=not stepping)
                except queue.Empty:
                    self._step()
                    continue
                if command == "close":
                    if self.state is State.SERVING:
                        self.engine.suspend()
                    if self._handoff is not None:
                        self._handoff.close(self.engine)
                    break
                self._handle(command, *payload)
        except Exception as error:  # a bug: every caller gets it (with its traceback), once each
            self._failure = error
        finally:
            self.state = State.CLOSED
            failure = self._failure or RuntimeError("the megatron inference engine closed")
            for pending in {id(p): p for p in self._pending.values()}.values():
                _settle(pending.future, None, failure)
            for future in self._refit_waiting:
                _settle(future, None, failure)
            while not self._commands.empty():
                command, payload = self._commands.get()
                if payload is not None:
                    _settle(payload[0], None, failure)

    def _handle(self, command: str, future: Future, payload: Any) -> None:
        if command == "add":
            prompt, greedy, limits = payload
            ids = [next(self._ids) for _ in limits]
            pending = _Pending(ids, len(prompt), future)
            self._pending.update(dict.fromkeys(ids, pending))
            if self.state is State.DOWN or self._refit_waiting:
                self._held.append((ids, prompt, greedy, limits))
            else:
                self._add(ids, prompt, greedy, limits)
            return
        if command == "refit":
            self._refit_waiting.append(future)  # done by the loop once nothing is unfinished
            return
        if command == "suspend":
            if self.state is State.SERVING:
                self.state = State.SUSPENDING
                if self.partial_rollouts:
                    self._frozen = self._tokens_so_far()
                self._freeze(self.engine)
                self.engine.suspend()
                if self._handoff is not None:
                    self._handoff.release(self.engine)
                self.state = State.DOWN
        elif command == "resume":
            if self.state is State.DOWN:
                self.state = State.RESUMING
                if self._handoff is not None:
                    self._handoff.restore(self.engine)
                self.wakes += 1
                for request_id, tokens in self._frozen.items():
                    prompt_tokens = self._pending[request_id].prompt_tokens
                    self._stretches[request_id].continue_at(tokens, self.wakes, prompt_tokens)
                self._frozen = {}
                self.engine.resume()
                self._serving()
                self._add_held()
                self.state = State.SERVING
        else:
            raise AssertionError(f"unknown command {command!r}")
        _settle(future, None)

    def _tokens_so_far(self) -> dict[int, int]:
        """Each unfinished request's tokens so far, by id (all in the engine: none is held while
        serving). megatron's latest record of a request checkpointed before (an eviction) has
        the tokens before that in its prompt."""
        counts = {}
        for request_id, pending in self._pending.items():
            request = self.engine.get_request(request_id)
            counts[request_id] = (
                len(request.prompt_tokens) - pending.prompt_tokens + len(request.generated_tokens)
            )
        return counts

    def _refit(self) -> None:
        """Refresh the served model (nothing is unfinished), then admit what waited."""
        assert self._refresh is not None, "only an engine apart is refitted"
        self._refresh()
        self._served = self._fingerprint()
        waiting, self._refit_waiting = self._refit_waiting, []
        for future in waiting:
            _settle(future, None)
        self._add_held()

    def _add_held(self) -> None:
        held, self._held = self._held, []
        for ids, prompt, greedy, limits in held:
            self._add(ids, prompt, greedy, limits)

    def _add(self, ids: list[int], prompt: Sequence[int], greedy: bool, limits: list[int]) -> None:
        for request_id in ids:
            self._stretches[request_id] = _Stretches(self.wakes)
        for request_id, limit in zip(ids, limits, strict=True):
            answered = self.engine.add_request(request_id, list(prompt), self.sampling(greedy, limit))
            # megatron answers at once only a request it failed (too long for its context or
            # cache), which would then never be stepped: what `generate` checks should prevent.
            if answered is not None and answered.done():
                raise RuntimeError(f"megatron's engine failed request {request_id} as it was added")

    def _step(self) -> None:
        result = self.engine.step_modern()
        for record in result["finished_request_records"]:
            request_id, tokens, logprobs = _generated(record)
            # Left in `_pending` until its completion is made: a failure here fails its caller too.
            pending = self._pending[request_id]
            stretches = self._stretches[request_id]
            assert tokens and len(logprobs) == len(tokens), (request_id, len(tokens), len(logprobs))
            assert stretches.starts[-1][0] < len(tokens), (request_id, stretches.starts, len(tokens))
            # Short of max_new_tokens without a stop token: its bench length ended it.
            stopped = tokens[-1] in self.stop_token_ids or len(tokens) < self.max_new_tokens
            del self._pending[request_id], self._stretches[request_id]
            pending.done[request_id] = Completion(
                tokens=tokens,
                logprobs=logprobs,
                finish_reason="stop" if stopped else "length",
                segments=tuple(stretches.starts) if self.partial_rollouts else (),
                reprefilled_tokens=stretches.reprefilled,
            )
            if len(pending.done) == len(pending.ids):
                _settle(pending.future, [pending.done[i] for i in pending.ids])


def _generated(record: Any) -> tuple[int, tuple[int, ...], tuple[float, ...]]:
    """A finished request's id, tokens and their logprobs, read over its records (one per
    recompute checkpoint, each with the tokens generated since the last). Not megatron's
    `merge()`: a record frozen before its first token has no logprobs list (None, as megatron
    makes it at the first token), and `merge()` then gives None for the whole request, or raises
    where a later record has none."""
    parts = record.requests
    tokens = tuple(token for part in parts for token in part.generated_tokens)
    logprobs = tuple(logprob for part in parts for logprob in part.generated_log_probs or ())
    return parts[0].request_id, tokens, logprobs
