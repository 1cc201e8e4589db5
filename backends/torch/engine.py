"""The torch generation engine behind the pipeline's `Engine` protocol.

Concurrent `generate(prompt, n)` calls (one per group) queue their requests; one continuous
decode loop (`Sampler.serve`) at a time runs them on the engine's compute thread. Whichever
caller finds no loop running gathers the requests queued with its own (a batch's groups) and
starts one: those open it, and its width (slots) follows from their rows. While it runs, the
loop takes further requests (of the same mode, greedy or not, in queue order, each whole, as
long as its rows and its prompt plus limit fit the free slots and the cache) from the queue at
each of its checks, as finished rows free their slots: this batch's late groups, the next
batch's when L >= 1. The queue is shared with the compute thread under a lock; the loop answers
a request once all its rows are back, and wakes only the callers of the requests answered at one
check, together (one `call_soon_threadsafe`): a multi-turn step's thousand callers each wait on
their own request, not on one event that every answer would wake them all from. Every waiting
caller looks again when the engine's state changes (a loop starts or ends, a wake, a refit
done), as one of them may have to start the next loop. The loop outlives the caller that started
it, so one caller's deadline never orphans the others; a request whose caller gave up (a
timeout, a stop) gives its slots back at the next check, and keeps nothing of its episode; when
the loop ends, a caller still waiting starts the next. A request of the other mode, one that
does not fit, more rows waiting than twice the loop's width (unless the loop is at `max_rows`),
a stand-down and a refit all make the loop admit nothing more, so it ends once its rows finish.
`max_rows` (`rollout.max_rows`) sets a loop's slots: it opens that wide with the requests that
fit under it, and the rest enter as rows finish; a loop opened by a few rows (those frozen at a
stand-down, continuing after the wake) is that wide too, so the next batch's requests enter at
once rather than wait for those rows, the long tail of the last batch, to end. On a bucketed
sampler (a GPU's) a loop whose live rows fit half its slots while nothing waits decodes at
their narrower width, and widens again for the requests that come (`Sampler.serve`'s
``narrow``): at L = 1 the slots a batch's tail leaves idle cannot be filled until the next
train step admits another batch, and a narrow step costs less than a full one.

Colocated (`shared=True`) the engine samples from the trainer's own parameter tensors: it must
stand down for training (its KV cache's memory is released) and waking it maps the cache again
and serves the new weights at once.
Otherwise it holds its own copy, keeps serving while the trainer works, and `refit` copies the
new weights in between two loops. A trainer whose weights are not a `Decoder` (the megatron
backend) gives `refresh_weights`, which brings the engine's model up to date from them: it runs
on the engine's thread at each wake and in each refit (instead of the copy from `source`),
before the new weights are served and fingerprinted.

Each request's own arguments are checked before it is queued: one that the model cannot
serve (a prompt too long for learned position embeddings) is refused with `RequestRejected`
instead of failing the loop of every request gathered with it.

Partial rollouts (``partial=True``, colocated): `stand_down` does not wait for the loop in
flight. It raises a flag that the sampler's loop reads at its next step boundary; the loop
hands back every live row with its tokens so far and ends, and the rows that had not finished
stay with their request, frozen (first in the queue again), while the KV cache is released.
No loop starts and nothing is admitted while the engine is down. After
the `wake` each frozen row continues under the new weights, as a prompt of its prompt plus its
tokens so far (prefilled again, `reprefilled_tokens`) with what is left of its length. Each
stretch of a row's tokens is tagged with `wakes` as it was generated (`Completion.segments`),
and every token keeps the logprob it was generated with. A frozen request lives only here: a
checkpoint never holds one (its batch is not trained yet, so a resume draws its prompt again).

Episodes (`keep_bytes` > 0; `kv_keep.py`): a one-row request that carries an ``episode`` key
leaves its row's keys and values kept under the key when it finishes; the episode's next
request, admitted fresh, takes them back if its prompt starts with the kept tokens, and only its
new tokens are prefilled (`Completion.reused_tokens` says how many were not). Anything else
prefills the whole prompt: nothing kept under the key (the first turn, an eviction, a retry
after a given-up attempt), a prompt that does not continue the kept tokens, or weights changed
since (a stand-down drops what is kept, its memory going back for training, so a wake finds
nothing kept; a refit and a weights load drop it too). A row frozen at a stand-down continues
re-prefilled as any other, and keeps its keys and values when it finishes. `end_episode` drops
an episode's entry.

``lengths`` (`rollout.bench_lengths`, a benchmark aid) ends each row at a length drawn for it
when its request arrives, with finish_reason "stop", as if the model had emitted its
end-of-sequence token there.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import torch

from backends.bench_lengths import LengthDraw
from backends.torch.compute import ComputeThread
from backends.torch.fingerprint import Fingerprinter, parameter_probes
from backends.torch.kv_keep import KVKeep
from backends.torch.model import Decoder
from backends.torch.sampler import Admission, Sampler
from backends.torch.sampling import check_arguments, check_prompts
from backends.torch.state_file import ENGINE_FILE, load_state, save_state
from pipeline.contracts.errors import RequestRejected
from pipeline.contracts.messages import Completion
from pipeline.contracts.protocols import SlotStats


class _Row:
    """One sampled sequence of a request, generated in one or more stretches."""

    __slots__ = ("frozen", "limit", "logprobs", "reason", "reprefilled", "reused", "segments", "tokens")

    def __init__(self, limit: int) -> None:
        self.limit = limit  # its length limit (max_new_tokens, or a bench length below it)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.segments: list[tuple[int, int]] = []
        self.reprefilled = 0
        self.reused = 0  # prompt tokens whose kept keys and values its first stretch restored
        self.frozen = False
        self.reason: str | None = None  # its finish_reason, once finished

    def completion(self, partial: bool) -> Completion:
        assert self.reason is not None
        return Completion(
            tokens=tuple(self.tokens),
            logprobs=tuple(self.logprobs),
            finish_reason=self.reason,
            segments=tuple(self.segments) if partial else (),
            reprefilled_tokens=self.reprefilled,
            reused_tokens=self.reused,
        )


class _Request:
    __slots__ = ("cancelled", "done", "episode", "greedy", "n", "prompt", "result", "rows", "woken")

    def __init__(self, prompt: Sequence[int], greedy: bool, limits: list[int], episode: str | None) -> None:
        self.prompt = list(prompt)
        self.episode = episode  # the key its row's keys and values are kept under (None: not kept)
        self.n = len(limits)
        self.greedy = greedy
        self.rows = [_Row(limit) for limit in limits]
        self.result: list[Completion] | BaseException | None = None
        self.done = False
        self.cancelled = False
        # Set (on the event loop) when it is answered or the engine's state changes: its caller looks again.
        self.woken = asyncio.Event()


def _sampler_requests(request: _Request) -> list[tuple[list[int], list[_Row]]]:
    """The unfinished rows of ``request`` as the sampler's (prompt, n) requests, each with its
    rows: rows with the same tokens so far (all rows before any freeze) share one prompt and
    its prefill; a continued row's prompt is its prompt plus its tokens so far."""
    if request.n == 1:  # most requests (an episode's turns): no grouping to do
        (row,) = request.rows
        return [(request.prompt + row.tokens, request.rows)] if row.reason is None else []
    alike: dict[tuple[int, ...], list[_Row]] = {}
    for row in request.rows:
        if row.reason is None:
            alike.setdefault(tuple(row.tokens), []).append(row)
    return [(request.prompt + list(tokens), rows) for tokens, rows in alike.items()]


class TorchEngine:
    def __init__(
        self,
        sampler: Sampler,
        *,
        shared: bool,
        source: Decoder,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        stop_token_ids: Sequence[int],
        seed: int,
        compute: ComputeThread | None = None,
        fingerprints: bool = False,
        refresh_weights: Callable[[], None] | None = None,
        partial: bool = False,
        lengths: LengthDraw | None = None,
        max_rows: int = 0,
        keep_bytes: int = 0,
    ) -> None:
        assert shared or not partial, "partial rollouts need an engine that stands down"
        self.sampler = sampler
        self.partial_rollouts = partial
        self.lengths = lengths
        self.max_rows = max_rows  # a loop's slots (0: its first admission's rows)
        self.kept = KVKeep(keep_bytes) if keep_bytes else None
        self.wakes = 0  # `wake` calls served (tags partial rollouts' stretches)
        self._freeze = threading.Event()  # read by the sampler's loop (partial rollouts)
        self._down = False
        self._busy_slot_steps = 0
        self._frozen_rows = 0
        self._reprefilled = 0
        self.fingerprints = fingerprints
        self.refresh_weights = refresh_weights
        self._fingerprinter: Fingerprinter | None = None
        self._served: dict[str, int] | None = None
        self.compute = compute or ComputeThread("engine")
        self.blocks_training = shared
        self.wake_carries_weights = shared
        self.source = source
        check_arguments([], max_new_tokens, temperature, top_p)  # once; prompts per request
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.stop_token_ids = tuple(stop_token_ids)
        self.generator = torch.Generator(device=sampler.device).manual_seed(seed)
        # The queue is read and changed by the event loop and by the loop's source (compute thread).
        self._lock = threading.Lock()
        self._queue: list[_Request] = []
        self._loop: asyncio.Future[None] | None = None  # the decode loop in flight
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._starting = False
        self._active: list[_Request] = []  # admitted to the loop in flight (compute thread)
        self._width = 0  # the loop in flight's slots
        self._paused = 0  # refits waiting for the loop to end
        self._callers: set[_Request] = set()  # requests whose callers wait in `generate`
        self.calls = 0  # decode loops run

    async def generate(
        self, prompt_tokens: Sequence[int], n: int, *, greedy: bool = False, episode: str | None = None
    ) -> list[Completion]:
        try:  # here, alone: in a batched call one bad prompt would fail all the others
            check_prompts(
                [list(prompt_tokens)],
                self.max_new_tokens,
                max_positions=self.sampler.model.config.position_limit,
            )
        except ValueError as error:
            raise RequestRejected(str(error)) from None
        limits = self.lengths.draw(n) if self.lengths is not None else [self.max_new_tokens] * n
        assert episode is None or n == 1, "an episode's request is one row"
        request = _Request(prompt_tokens, greedy, limits, episode if self.kept is not None else None)
        with self._lock:
            self._queue.append(request)
        self._callers.add(request)
        try:
            while not request.done:
                if self._loop is None and not self._starting and self._may_start():
                    self._starting = True
                    try:
                        await self._gather()
                        if self._may_start():
                            self._start_loop()
                    finally:
                        self._starting = False
                        self._notify()  # a loop runs now, or another caller may start one
                    continue
                request.woken.clear()  # no await since the checks above: nothing set it unseen
                await request.woken.wait()
        finally:
            self._callers.discard(request)
            request.cancelled = True  # answered, or given up: nobody should sample for it
            with self._lock:
                if request in self._queue:
                    self._queue.remove(request)
        if isinstance(request.result, BaseException):
            raise request.result
        assert request.result is not None
        return request.result

    async def _gather(self) -> None:
        """Yield to the event loop until no new request arrived for two rounds, so the groups
        started together (a batch's prompts) open one loop together, not the first alone."""
        quiet, seen = 0, len(self._queue)
        while quiet < 2:
            await anyio.lowlevel.checkpoint()
            quiet = quiet + 1 if len(self._queue) == seen else 0
            seen = len(self._queue)

    def _may_start(self) -> bool:
        return bool(self._queue) and not self._down and not self._paused

    def _start_loop(self) -> None:
        """Run one decode loop on the compute thread; it outlives the caller that starts it
        (every waiting caller is answered through `_finish`, and the next loop is started by
        whichever caller still waits when this one ends)."""
        self._event_loop = asyncio.get_running_loop()
        self._loop = self.compute.submit(self._serve, self._queue[0].greedy)
        self._loop.add_done_callback(self._loop_ended)

    def _loop_ended(self, loop: asyncio.Future[None]) -> None:
        self._loop = None
        if not loop.cancelled() and (error := loop.exception()) is not None:
            # Escaped `_serve` (a bug there): every caller gets it rather than wait forever.
            for request in self._active + self._queue:
                request.result, request.done = error, True
        self._notify()

    def _serve(self, greedy: bool) -> None:
        """One decode loop (compute thread) over the requests of one mode (greedy or not),
        admitted from the queue as slots free up; requests with frozen rows go back to the
        front of the queue when it ends."""
        self.calls += 1
        active: list[_Request] = []
        self._active = active
        self._width = 0  # the rows of its first admission, then its slots
        try:
            self.sampler.serve(
                functools.partial(self._admit, greedy, active),
                self._finish,
                max_new_tokens=self.max_new_tokens,
                temperature=0.0 if greedy else self.temperature,
                top_p=self.top_p,
                stop_token_ids=self.stop_token_ids,
                generator=self.generator,
                freeze=self._freeze if self.partial_rollouts else None,
                dropped=lambda admission: admission.key[0].cancelled,
                width=self.max_rows,
                kept=self.kept,
            )
        except Exception as error:
            for request in active:
                if not request.done:
                    request.result, request.done = error, True
            self._wake_callers()
            return
        with self._lock:
            # Requests with frozen rows go first again, ahead of those that arrived since.
            self._queue[:0] = [r for r in active if not r.done and not r.cancelled]
        self._wake_callers()

    def _admit(
        self, greedy: bool, active: list[_Request], rows: int | None, positions: int | None
    ) -> list[Admission]:
        """The sampler's source (compute thread): requests from the front of the queue, in
        order, while they are of the loop's mode and fit the free ``rows`` and the cache's
        ``positions`` (at the loop's start: all of them, or up to `max_rows`); none while the
        engine stands down or a refit waits, nor while more than twice the loop's width waits
        and it is narrower than `max_rows` (a loop opened by a few requests, a retried group,
        must not take the next batch through a few slots: it ends once its rows finish, and
        the next opens wide enough)."""
        admissions: list[Admission] = []
        if rows is not None and self.max_rows:  # slots past the cap (a graph bucket's padding) stay idle
            rows -= max(0, self._width - self.max_rows)
        with self._lock:
            if rows is not None and not (self.max_rows and self._width >= self.max_rows):
                waiting = sum(row.reason is None for r in self._queue if r.greedy == greedy for row in r.rows)
                if waiting > 2 * self._width:
                    return admissions
            while self._queue and not (self._down or self._paused or self._freeze.is_set()):
                request = self._queue[0]
                if request.greedy != greedy:
                    break
                parts = _sampler_requests(request)
                wanted = sum(len(same) for _, same in parts)
                longest = max(
                    len(prompt) + row.limit - len(row.tokens) for prompt, same in parts for row in same
                )
                if rows is not None and positions is not None and (wanted > rows or longest > positions):
                    break
                if rows is None and self.max_rows and self._width and self._width + wanted > self.max_rows:
                    break  # the loop opens at its cap; the rest enter as its rows finish
                self._queue.pop(0)
                active.append(request)
                if rows is not None:
                    rows -= wanted
                else:
                    self._width += wanted
                for prompt, same in parts:
                    if same[0].frozen:  # rows that share a prompt were frozen together
                        self._reprefilled += len(prompt)  # the work: one prefill for them all
                    for row in same:
                        if row.frozen:
                            row.reprefilled += len(prompt)  # what continuing it alone would take
                            row.frozen = False
                    limits = [row.limit - len(row.tokens) for row in same]
                    cached = None
                    if request.episode is not None and not same[0].tokens:
                        assert self.kept is not None, "a request keeps its episode only where kept"
                        cached = self.kept.take(request.episode, prompt)
                        same[0].reused = len(cached.tokens) if cached is not None else 0
                    admissions.append(Admission(prompt, limits, (request, same), cached, request.episode))
            if rows is None:  # the loop opens `max_rows` wide, whatever opens it (`serve`'s width)
                self._width = self.sampler.width_for(max(self._width, self.max_rows))
        return admissions

    def _finish(self, back: list[tuple[Admission, list[Completion]]]) -> None:
        """The sampler's sink (compute thread): admissions whose rows are back, finished or
        frozen, all those of one check; the requests whose rows have all finished are answered,
        their callers woken together (one call into the event loop)."""
        answered: list[_Request] = []
        for admission, out in back:
            request, rows = admission.key
            self._busy_slot_steps += sum(len(c.tokens) for c in out)
            for row, completion in zip(rows, out, strict=True):
                if completion.tokens:
                    row.segments.append((len(row.tokens), self.wakes))
                    row.tokens.extend(completion.tokens)
                    row.logprobs.extend(completion.logprobs)
                if completion.finish_reason == "frozen":
                    row.frozen = True
                    self._frozen_rows += 1
                elif completion.finish_reason == "length" and len(row.tokens) < self.max_new_tokens:
                    row.reason = "stop"  # its bench length: as if it had emitted end-of-sequence
                else:
                    row.reason = completion.finish_reason
            if all(row.reason is not None for row in request.rows):
                request.result = [row.completion(self.partial_rollouts) for row in request.rows]
                request.done = True
                answered.append(request)
        if answered:
            self._call_soon(self._answer, answered)

    def _wake_callers(self) -> None:
        """From the compute thread: let every waiting caller look again."""
        self._call_soon(self._notify)

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the event loop, from the compute thread (unless the loop has
        closed under a decode loop that outlived it)."""
        assert self._event_loop is not None, "set when the loop started"
        if not self._event_loop.is_closed():
            self._event_loop.call_soon_threadsafe(fn, *args)

    @staticmethod
    def _answer(requests: list[_Request]) -> None:
        """Wake the callers of ``requests`` (answered): only theirs, not every waiting caller."""
        for request in requests:
            request.woken.set()

    def statistics(self) -> SlotStats:
        times = self.sampler.times
        return SlotStats(
            slot_steps=self.sampler.slot_steps,
            busy_slot_steps=self._busy_slot_steps,
            frozen_rows=self._frozen_rows,
            reprefilled_tokens=self._reprefilled,
            frozen_now=self._frozen_now(),
            decode_steps=times.decode_steps,
            loop_s=times.serve_s,
            loop_check_s=times.check_s,
            loop_prefill_s=times.prefill_s,
            loop_wait_s=times.wait_s,
        )

    def _frozen_now(self) -> int:
        with self._lock:
            return sum(row.frozen for r in self._queue for row in r.rows)

    def _notify(self) -> None:
        """The engine's state changed (a loop started or ended, a wake, a refit done): every
        waiting caller looks again, as one may have to start the next loop."""
        for request in self._callers:
            request.woken.set()

    async def stand_down(self) -> None:
        """Release the KV cache once the loop in flight has ended (the release runs on the
        compute thread after it): with partial rollouts it freezes at its next step; otherwise
        it admits nothing more and ends when its rows finish."""
        self._down = True
        if self.partial_rollouts:
            self._freeze.set()
        await self.compute.run(self._release)

    def _release(self) -> None:
        self._drop_kept()  # their memory goes back for training
        self.sampler.release()

    def _drop_kept(self) -> None:
        """Drop every episode's kept keys and values (at a stand-down, and when the served
        weights change: they were the old weights')."""
        if self.kept is not None:
            self.kept.clear()

    def end_episode(self, episode: str) -> None:
        """Drop what is kept of ``episode`` (it has ended); harmless if nothing is."""
        if self.kept is not None:
            self.kept.forget(episode)

    async def wake(self) -> None:
        """No weights to load: colocated, the engine reads the trainer's tensors. The sampler
        maps its KV cache's memory again; frozen rows continue."""
        self.wakes += 1
        await self.compute.run(self._wake)
        self._freeze.clear()
        self._down = False
        self._notify()

    def _wake(self) -> None:
        if self.refresh_weights is not None:
            self.refresh_weights()
        self.sampler.wake()
        self._take_fingerprint()

    async def refit(self) -> None:
        await self._between_loops(self._copy_weights)

    async def _between_loops(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn`` on the compute thread once the loop in flight has ended: no loop admits
        while a refit waits, and the thread runs one call at a time in order."""
        self._paused += 1
        try:
            await self.compute.run(fn, *args)
        finally:
            self._paused -= 1
            self._notify()

    @torch.no_grad()
    def _copy_weights(self) -> None:
        self._drop_kept()
        if self.refresh_weights is not None:
            self.refresh_weights()
        elif self.sampler.model is not self.source:
            for target, value in zip(self.sampler.model.parameters(), self.source.parameters(), strict=True):
                target.copy_(value)
        self._take_fingerprint()

    def served_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """The weights its sampler reads, by the `Decoder`'s names: what `load_weights` takes
        (and how a weights package unpacks into them)."""
        return list(self.sampler.model.named_parameters())

    async def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy `weights` (every parameter, by name) into the served model between two loops:
        the refit of an engine whose trainer is in another process."""
        await self._between_loops(self._load_weights, weights)

    @torch.no_grad()
    def _load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._drop_kept()
        for name, target in self.sampler.model.named_parameters():
            target.copy_(weights[name])
        self._take_fingerprint()

    def _take_fingerprint(self) -> None:
        """What the sampler serves now (`fingerprint`), when asked for at construction: the
        parameters of its model, which it reads where they are."""
        if not self.fingerprints:
            return
        if self._fingerprinter is None:
            self._fingerprinter = Fingerprinter(parameter_probes(self.sampler.model.named_parameters()))
        self._served = self._fingerprinter()

    def fingerprint(self) -> dict[str, int] | None:
        return self._served

    def save(self, directory: Path) -> None:
        save_state(directory / ENGINE_FILE, self.state())

    def load(self, directory: Path) -> None:
        self.load_state(load_state(directory / ENGINE_FILE))

    def state(self) -> dict[str, Any]:
        """The sampling RNG (and the bench lengths' draw); frozen requests are never saved."""
        state: dict[str, Any] = {"generator": self.generator.get_state()}
        if self.lengths is not None:
            state["lengths"] = self.lengths.state()
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore the sampling RNG; weights come from the trainer (shared, or a refit)."""
        self.generator.set_state(state["generator"])
        if self.lengths is not None and "lengths" in state:
            self.lengths.load_state(state["lengths"])
        self._copy_weights()

    def close(self) -> None:
        """Stop the compute thread (after its current call)."""
        self.compute.close()

    def memory_in_use(self) -> int | None:
        return self.sampler.cache_bytes() + (self.kept.resident_bytes if self.kept is not None else 0)
