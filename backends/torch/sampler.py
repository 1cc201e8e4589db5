"""The sampler: completions with per-token logprobs for ``(prompt, n)`` requests, over a
`Decoder`, on any device.

One decode loop, continuous (`Sampler.serve`): a fixed number of slots, each a row of the
`KVCache` and of the decode step. An admission (n rows of one prompt) is prefilled once
(right-padded, causal: padding never reaches a real token) into its n free slots; the first
token of every row is drawn from the prefill's last hidden state, and each further one by a
decode step (`decode_step.py`: replayed from a CUDA graph on a GPU, eager elsewhere) over
every slot. A row finishes at a stop token or its own limit; an admission whose rows have all
finished is handed back at the next check, and its slots are refilled from what waits, while
the other rows go on. `Sampler.generate` is that loop given every request up front. Each
`Completion`'s ``logprobs[i]`` is log_softmax(logits / T)[tokens[i]] before any top-p
truncation (temperature 1 when greedy); a stop token, when hit, is the last token. All
randomness comes from the caller's generator, on the sampler's device: equal generator state,
inputs and admission order give equal outputs.

Rows. With graphs (or compiled parts) a loop's width is its first admissions' rows padded to a
bucket (`_BUCKETS`) so few shapes are captured or compiled, and one graph serves the whole
loop; the cache grows (between loops only) to the largest bucket and length seen, and growing
it drops the steps and their graphs. Eager (CPU), the width is exactly those rows.

Rounding. Compiled kernels keep float32 intermediates where eager ops round to bf16; the
engine's logprobs agree best with a trainer that rounds the same way. By default the sampler
rounds as compiled kernels do (`train.compile`'s trainer); ``eager_rounding`` rounds as eager
ops do, for a trainer without it: decode parts emulate eager's casts and the prefill runs its
layers uncompiled. Compiled, the prefill shares the trainer's `compiled_layer_parts`.

Episodes (`kv_keep.py`). An admission of one row may carry keys and values kept from its
episode's last turn: they are restored into its slot and only the rest of its prompt is
prefilled (`_extend`, together, outside the graphs); one with a ``keep`` key leaves its row's keys
and values in `serve`'s ``kept`` when it comes back.

Colocation. The steps read the model's parameter tensors in place: the trainer must update
them in place (optimizers do), never rebind them. `release` hands the cache's memory back to
the driver; `wake` maps it again, at the same addresses where the pool allows (the graphs stay
valid), else the graphs are dropped and captured again on the next call.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Concatenate, NamedTuple, ParamSpec

import torch
from torch import Tensor

from backends.torch import race
from backends.torch.attention import attend
from backends.torch.decode_step import DecodeStep, DecodeSteps, flash_works
from backends.torch.kv_cache import KVCache
from backends.torch.kv_keep import KeptKV, KVKeep, never_given_up
from backends.torch.kv_pool import KVPool, make_pool
from backends.torch.loop_times import LoopTimes
from backends.torch.model import PLAIN_PARTS, Decoder, compiled_layer_parts
from backends.torch.sampling import check_arguments, completions, draw
from pipeline.contracts.messages import Completion

_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)
_P = ParamSpec("_P")
# Tokens of the prefill forward at once (bounds prefill activation memory).
_PREFILL_TOKENS = 32768


def _bucket(n: int) -> int:
    for b in _BUCKETS:
        if b >= n:
            return b
    return -(-n // _BUCKETS[-1]) * _BUCKETS[-1]


def _copied_to(host: Tensor, device: torch.device) -> Tensor:
    """A host tensor on ``device``; on CUDA copied from pinned memory without waiting: a copy
    from pageable memory first waits for everything the stream has queued, so an admission's
    inputs would wait for the decode steps launched before its prefill (`Sampler.admit_lead`)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _tensor_on(device: torch.device, values: Sequence[Any], dtype: torch.dtype | None = None) -> Tensor:
    """``values`` (numbers, or equal-length lists of them) as a tensor on ``device`` (`_copied_to`)."""
    return _copied_to(torch.tensor(values, dtype=dtype), device)


class Admission(NamedTuple):
    """``len(limits)`` rows continuing ``prompt`` (prefilled once for them all): row i ends
    after ``limits[i]`` new tokens unless a stop token ends it first. ``key``: the source's,
    handed back with the Completions.

    Episodes (`kv_keep.py`), one row only: ``cached``, kept keys and values of the prompt's
    first tokens, restored into the row's slot so only the rest is prefilled; ``keep``, the key
    under which `serve`'s ``kept`` keeps the row's keys and values once it finishes."""

    prompt: list[int]
    limits: list[int]
    key: Any = None
    cached: KeptKV | None = None
    keep: Hashable | None = None


# `Sampler.serve`'s source(rows, positions) gives admissions; its sink takes them back, each
# with one Completion per row once all its rows have finished (or at a freeze), all those of
# one check in one call.
Source = Callable[[int | None, int | None], Sequence[Admission]]
Sink = Callable[[list[tuple[Admission, list[Completion]]]], None]


def _timed(serve: Callable[Concatenate[Sampler, _P], None]) -> Callable[Concatenate[Sampler, _P], None]:
    """`Sampler.serve` inside its `LoopTimes.loop()`: the loop's time, and its last check's."""

    @functools.wraps(serve)
    def timed(sampler: Sampler, *args: _P.args, **kwargs: _P.kwargs) -> None:
        with sampler.times.loop():
            serve(sampler, *args, **kwargs)

    return timed


class Sampler:
    """``graphs``: capture decode steps (CUDA only). ``flash``: variable-length flash attention
    for decode (CUDA in half precision only; otherwise `attend` with a length mask).
    ``compiled`` (default: when capturing graphs): torch.compile'd parts around attention, for
    decode and prefill. ``check_every``: decode steps between a loop's checks for finished rows
    and free slots (each check waits for the device; default 32 on CUDA, 1 elsewhere).
    ``admit_lead``: decode steps a loop launches for its live rows between a check that takes
    admissions and their prefill (default a quarter of ``check_every``)."""

    def __init__(
        self,
        model: Decoder,
        *,
        graphs: bool = True,
        flash: bool = True,
        compiled: bool | None = None,
        eager_rounding: bool = False,
        pool: KVPool | None = None,
        check_every: int | None = None,
        admit_lead: int | None = None,
    ) -> None:
        param = next(model.parameters())
        self.model = model
        self.device = param.device
        cuda = self.device.type == "cuda"
        graphs = graphs and cuda
        flash = flash and cuda and param.dtype in (torch.bfloat16, torch.float16) and flash_works(self.device)
        self.compiled = graphs if compiled is None else compiled
        self.eager_rounding = eager_rounding
        self.check_every = check_every or (32 if cuda else 1)
        self.admit_lead = self.check_every // 4 if admit_lead is None else admit_lead
        assert 0 <= self.admit_lead < self.check_every, "admissions must go in before the next check"
        self.cache = KVCache(
            model.config,
            param.dtype,
            pool if pool is not None else make_pool(self.device),
            zero_fresh=not flash,
        )
        self.steps = DecodeSteps(
            model,
            self.cache,
            graphs=graphs,
            flash=flash,
            compiled=self.compiled,
            eager_rounding=eager_rounding,
        )
        self._bucketed = graphs or self.compiled
        self._down = False
        self.slot_steps = 0  # slots x decode steps of every loop so far, counted at each check
        self.times = LoopTimes(self.device)  # decode steps, and where the loops' time went

    @property
    def captures(self) -> int:
        """CUDA graphs captured so far."""
        return self.steps.captures

    def width_for(self, rows: int) -> int:
        """The slots of a loop that ``rows`` rows open (`serve`)."""
        return _bucket(rows) if self._bucketed else rows

    # ---- memory and handoff -------------------------------------------------------------

    def cache_bytes(self) -> int:
        """Device bytes the KV cache holds now (0 while stood down or before the first call)."""
        return self.cache.resident_bytes

    def release(self) -> None:
        """Stand down: free the KV cache's memory; graphs are kept for `wake`."""
        if self.cache.rows and not self._down:
            self.cache.release()
            self._down = True

    @torch.no_grad()
    def wake(self) -> None:
        """Map the KV cache again (same addresses where the pool allows; otherwise the graphs
        are dropped and captured again on the next call)."""
        if not self._down:
            return
        self._down = False
        if self.cache.restore():
            self.steps.drop()

    def _ensure(self, rows: int, length: int) -> None:
        self.wake()
        if not self.cache.fits(rows, length):
            self.steps.drop()
            self.cache.grow(rows, length)

    # ---- generation ---------------------------------------------------------------------

    @torch.inference_mode()
    def generate(
        self,
        requests: Sequence[tuple[Sequence[int], int]],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] = (),
        generator: torch.Generator,
        limits: Sequence[int] | None = None,
        freeze: threading.Event | None = None,
    ) -> list[list[Completion]]:
        """Up to ``max_new_tokens`` tokens after each request's prompt, n times: one list of n
        Completions per ``(prompt, n)`` request. ``temperature`` 0 is greedy (``top_p`` then
        unused). One `serve` loop given every request up front (all admitted at once).

        ``limits``: one per row (the requests' rows in order): row i ends after ``limits[i]``
        tokens (finish_reason "length") unless a stop token ends it first. ``freeze``: as in
        `serve` (the rows that had not finished come back "frozen" with their tokens so far).
        """
        prompts = [list(prompt) for prompt, _ in requests]
        counts = [n for _, n in requests]
        row_prompts = [p for p, n in zip(prompts, counts, strict=True) for _ in range(n)]
        check_arguments(
            row_prompts if limits is not None else prompts,
            max_new_tokens,
            temperature,
            top_p,
            max_positions=self.model.config.position_limit,
            limits=limits,
        )
        bounds = list(limits) if limits is not None else [max_new_tokens] * len(row_prompts)
        admissions, first = [], 0
        for i, (prompt, n) in enumerate(zip(prompts, counts, strict=True)):
            if n:
                admissions.append(Admission(prompt, bounds[first : first + n], i))
            first += n
        out: list[list[Completion]] = [[] for _ in requests]

        def source(rows: int | None, positions: int | None) -> list[Admission]:
            given = admissions[:] if rows is None else []
            admissions.clear()
            return given

        def sink(back: list[tuple[Admission, list[Completion]]]) -> None:
            for admission, done in back:
                out[admission.key] = done

        self.serve(
            source,
            sink,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            stop_token_ids=stop_token_ids,
            generator=generator,
            freeze=freeze,
        )
        return out

    @torch.inference_mode()
    @_timed
    def serve(
        self,
        source: Source,
        sink: Sink,
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] = (),
        generator: torch.Generator,
        freeze: threading.Event | None = None,
        dropped: Callable[[Admission], bool] | None = None,
        width: int = 0,
        narrow: bool = True,
        kept: KVKeep | None = None,
    ) -> None:
        """The continuous decode loop: a fixed number of slots (rows of the cache and of the
        decode step), filled from ``source`` and emptied into ``sink``; returns once no row is
        live and the source gives nothing.

        Slots. The first call ``source(None, None)`` gives what is waiting; the loop's width is its
        rows, or ``width`` if more (bucketed with graphs, so one captured step serves the
        whole loop: a loop opened by a few rows that more will join), and the cache is
        grown, if it must, to fit its longest prompt plus ``max_new_tokens``. Growing
        happens only here, between loops. Every ``check_every`` steps (and once every live
        row must have reached its limit) the loop waits for the device, takes every finished
        row's tokens off it in one copy and frees its slot, hands the admissions whose rows
        are all back to ``sink`` in one call, each with its Completions (in its rows'
        order), and offers the free slots to ``source(rows, positions)``, which gives
        admissions of at most ``rows`` rows in all, each row's prompt plus limit at most
        ``positions`` (the cache's length) and each limit at most ``max_new_tokens``. An
        admission's prompt is prefilled once into exactly its slots (the lowest free ones,
        in order), its rows' positions, limits and first tokens set; a finished row's slot
        computes a wasted row until it is refilled. While rows are live, a check's admissions
        are prefilled `admit_lead` steps after it: the prefill's host work (hundreds of kernel
        launches) then runs while the device decodes those steps, instead of the device
        waiting for it after the check's wait. Admissions of a refill are drawn and
        decoded after the rows already live, in the order given, so equal generator state,
        inputs and admission order give equal outputs.

        ``dropped``: asked at each check of every live admission; one it says to drop (its
        caller gave up) has its unfinished rows' slots freed at once and never reaches ``sink``.
        Asked of each admission as it goes in too: one given up is never prefilled.
        Asked again as a finished row's keys and values are kept (``kept``): one given up since
        the check keeps nothing.

        ``freeze``: a host flag read at each step boundary; once set (and the admissions a check
        took are in), the loop hands every live admission to ``sink`` at once, the rows that
        had not finished with finish_reason "frozen" and their tokens so far (partial
        rollouts), and returns without asking the source again.

        ``narrow`` (bucketed loops): at a check where the source gave nothing and the live rows
        fit half the slots, the loop moves them (their cache rows, tokens so far and state) to
        the lowest slots and goes on at their bucket's width (`_moved`), so a long tail's
        last rows decode in a narrow step instead of the full width's. A narrowed loop still
        offers the source the slots it opened with: when it gives more rows than the narrow
        width has free, the loop widens again (the same move) to their bucket, so requests
        that come later (the next batch) enter at once instead of waiting for the tail.

        ``kept``: where an admission with a ``keep`` key keeps its row's keys and values when
        the row comes back, before the admission reaches ``sink``: the rows of one check in one
        copy (`_keep`).
        """
        first = list(source(None, None))
        if not first:
            return
        dev = self.device
        rows = self.width_for(max(width, sum(len(a.limits) for a in first)))
        # Room for every row up to max_new_tokens, so later admissions of such prompts fit.
        self._ensure(rows, max(len(a.prompt) for a in first) + max_new_tokens)
        positions = self.cache.length
        greedy = temperature == 0
        step = self.steps.get(rows, draws=greedy or top_p == 1)
        step.position.zero_()  # slots never filled stay at 0 (a step's buffers outlive its loop)
        step.inv_temperature.fill_(1.0 if greedy else 1.0 / temperature)
        step.noisy.fill_(0.0 if greedy else 1.0)
        if greedy and step.draws and not step.race:
            step.noise.fill_(1.0)

        stop = torch.tensor(list(stop_token_ids), dtype=torch.long, device=dev)
        # Per slot; column `generated` takes the next token (one spare column for finished rows).
        tokens = torch.zeros(rows, max_new_tokens + 1, dtype=torch.long, device=dev)
        logprobs = torch.zeros(rows, max_new_tokens + 1, dtype=torch.float32, device=dev)
        generated = torch.zeros(rows, dtype=torch.long, device=dev)
        limit = torch.zeros(rows, dtype=torch.long, device=dev)
        done = torch.ones(rows, dtype=torch.bool, device=dev)
        token = torch.zeros(rows, dtype=torch.long, device=dev)
        logprob = torch.zeros(rows, dtype=torch.float32, device=dev)
        loop = _Slots(rows)
        full = rows  # the cache's rows for this loop: a narrowed loop widens back up to them
        pending = first
        count = checked = admit_at = 0
        while True:
            if pending and count >= admit_at and dropped is not None:  # given up while waiting
                pending = [a for a in pending if not dropped(a)]
            if pending and count >= admit_at:
                self.times.prefill_begins()
                slots = loop.admit(pending, count)
                index = _tensor_on(dev, slots)
                step.position[index] = _tensor_on(dev, [len(a.prompt) for a in pending for _ in a.limits])
                limit[index] = _tensor_on(dev, [n for a in pending for n in a.limits])
                generated.index_fill_(0, index, 0)  # `x[index] = 0` copies 0 to the device: a wait
                done.index_fill_(0, index, False)
                first_token, first_logprob = self._first_tokens(
                    pending, slots, step, temperature, top_p, generator
                )
                token[index], logprob[index] = first_token, first_logprob
                pending = []
                self.times.prefill_ends()
            tokens.scatter_(1, generated.unsqueeze(1), token.unsqueeze(1))
            logprobs.scatter_(1, generated.unsqueeze(1), logprob.unsqueeze(1))
            generated += ~done
            if stop.numel():
                done |= torch.isin(token, stop)
            done |= generated >= limit
            count += 1
            frozen = freeze is not None and freeze.is_set()  # a host flag: no device sync
            if frozen and pending:  # the admissions taken go in first, and come back frozen
                frozen, admit_at = False, count
            if frozen or count % self.check_every == 0 or count >= loop.last:
                self.slot_steps += rows * (count - checked)
                self.times.decode_steps += count - checked
                checked = count
                if dropped is not None and (freed := loop.drop(dropped)):
                    done.index_fill_(0, _tensor_on(dev, freed), True)  # no longer generating
                with self.times.waiting():
                    done_list = done.tolist()  # waits for the device
                self.times.check_begins()
                self._hand_over(
                    loop, done_list, generated, tokens, logprobs, stop_token_ids, sink, frozen, kept, dropped
                )
                if frozen:
                    break
                # A narrowed loop offers the slots it had at its start: it widens for what comes.
                # Admissions taken but not yet in (`admit_lead`) hold free slots: none asked then.
                if not pending and (room := len(loop.free) + full - rows):
                    pending = list(source(room, positions))
                    admit_at = count + self.admit_lead
                    assert all(
                        len(a.prompt) + max(a.limits) <= positions and max(a.limits) <= max_new_tokens
                        for a in pending
                    ), "the source broke its bounds"
                if not loop.live:
                    if not pending:
                        break
                    admit_at = count  # no step to overlap the prefill with
                resized = rows
                if (wanted := sum(len(a.limits) for a in pending)) > len(loop.free):
                    resized = self.width_for(rows - len(loop.free) + wanted)
                elif (
                    narrow
                    and not pending
                    and self._bucketed
                    and self.width_for(rows - len(loop.free)) <= rows // 2
                ):
                    resized = self.width_for(rows - len(loop.free))
                if resized != rows:
                    live = sorted(slot for _, _, slot in loop.finished(done_list, everything=True))
                    old_step = step
                    step = self.steps.get(resized, draws=old_step.draws)
                    state = (tokens, logprobs, generated, limit, done, token, logprob)
                    tokens, logprobs, generated, limit, done, token, logprob = self._moved(
                        live, resized, loop, old_step, step, state
                    )
                    rows = resized
                    if greedy and step.draws and not step.race:
                        step.noise.fill_(1.0)
                self.times.check_ends()
            if token is not step.token:
                step.token.copy_(token)
            if step.draws and not greedy:
                if step.race:
                    step.seed.random_(generator=generator)
                else:
                    step.noise.exponential_(generator=generator)
            self.steps.run(step, min(loop.reach + count, positions))
            # A finished row's position stays put, inside its prompt plus its own limit.
            step.position += ~done
            if step.draws:
                # Read (by the copies above) before the next replay overwrites them.
                token, logprob = step.token, step.logprob
            else:
                # step.logits holds logits / temperature.
                token, logprob = draw(step.logits, 1.0, top_p, generator)

    def _moved(
        self,
        live: list[int],
        width: int,
        loop: _Slots,
        old: DecodeStep,
        step: DecodeStep,
        state: tuple[Tensor, ...],
    ) -> tuple[Tensor, ...]:
        """Move the rows in slots ``live`` (ascending) to slots 0.. of a loop ``width`` wide
        decoding with ``step``: their keys and values (the positions written so far), the
        loop's per-slot ``state`` tensors (new ones, ``width`` rows; the rest as never-filled
        slots: done, at position 0) and the slots' book."""
        dev = self.device
        # long: ``live`` is empty where a loop widens at the check its last rows ended.
        index = torch.tensor(live, dtype=torch.long, device=dev)
        n = len(live)
        span = int(old.position[index].max()) + 1 if n else 0
        for layer in range(self.cache.layers):
            for kv in (self.cache.keys[layer], self.cache.values[layer]):
                kv[:n, :, :span] = kv[index, :, :span]  # the gather copies before the write
        step.position.zero_()
        step.position[:n] = old.position[index]
        step.inv_temperature.copy_(old.inv_temperature)
        step.noisy.copy_(old.noisy)
        moved = []
        for tensor in state:
            shape = (width, *tensor.shape[1:])
            fresh = tensor.new_ones(shape) if tensor.dtype == torch.bool else tensor.new_zeros(shape)
            fresh[:n] = tensor[index]
            moved.append(fresh)
        loop.renumber({slot: new for new, slot in enumerate(live)}, width)
        return tuple(moved)

    def _first_tokens(
        self,
        admissions: list[Admission],
        slots: list[int],
        step: DecodeStep,
        temperature: float,
        top_p: float,
        generator: torch.Generator,
    ) -> tuple[Tensor, Tensor]:
        """Prefill ``admissions`` into their ``slots``; each row's first token and its logprob,
        drawn from the prefill's last hidden states (outside the graphs)."""
        hidden = self._prefill_admissions(admissions, slots)
        logits = self.model.lm_head(hidden)
        if step.race:
            step.seed.random_(generator=generator)
            return race.race_draw(logits, step.inv_temperature, step.seed, step.noisy)
        return draw(logits.float(), temperature, top_p, generator)

    def _hand_over(
        self,
        loop: _Slots,
        done: list[bool],
        generated: Tensor,
        tokens: Tensor,
        logprobs: Tensor,
        stop_token_ids: Sequence[int],
        sink: Sink,
        frozen: bool,
        kept: KVKeep | None,
        dropped: Callable[[Admission], bool] | None,
    ) -> None:
        """Take every finished row (every live row at a freeze, those not ``done`` "frozen")
        off the device in one copy and free its slot (their keys and values kept first, in one
        copy, where their admissions ask and ``dropped`` does not say their callers gave up,
        `_keep`); hand the admissions whose rows are all back to ``sink`` in one call."""
        rows = loop.finished(done, everything=frozen)
        if not rows:
            return
        index = torch.tensor([slot for _, _, slot in rows], device=tokens.device)
        counts = generated[index].tolist()
        columns = max(counts)
        out = completions(
            counts,
            tokens[index, :columns].tolist(),
            logprobs[index, :columns].tolist(),
            stop_token_ids,
            [not done[slot] for _, _, slot in rows] if frozen else None,
        )
        keeping: list[tuple[Admission, Completion, int]] = []
        for (live, row, slot), completion in zip(rows, out, strict=True):
            live.out[row] = completion
            if kept is not None and live.admission.keep is not None:
                keeping.append((live.admission, completion, slot))
        if keeping:
            assert kept is not None
            self._keep(kept, keeping, dropped)
        back = loop.release(rows)
        if back:
            sink([(live.admission, [c for c in live.out if c is not None]) for live in back])

    def _keep(
        self,
        kept: KVKeep,
        rows: list[tuple[Admission, Completion, int]],
        dropped: Callable[[Admission], bool] | None,
    ) -> None:
        """Copy the keys and values of each ``(admission, completion, slot)`` row into ``kept``
        under its admission's key: its prompt and every generated token but the last (the last
        one's position the loop may have written since with a wasted step's draw); nothing for
        one that ``dropped`` says, as it is kept, its caller gave up (after the check that would
        have dropped it). One gather over every layer copies the rows' positions into a pack
        (`kv_keep.py`) whose slices the entries are; rows go in several packs where one would
        not fit half the keep's budget (a pack is kept, and freed, whole)."""
        assert all(len(a.limits) == 1 for a, _, _ in rows), "one row per kept admission"
        cache = self.cache
        per_token = cache.every[:, :, 0, :, 0].numel() * cache.every.element_size()
        known = [len(a.prompt) + len(c.tokens) - 1 for a, c, _ in rows]
        packs: list[list[int]] = [[]]
        size = 0
        for i, k in enumerate(known):
            if packs[-1] and (size + k) * per_token > kept.budget // 2:
                packs.append([])
                size = 0
            packs[-1].append(i)
            size += k
        entries = []
        for pack in packs:
            slot, at = _positions([rows[i][2] for i in pack], [known[i] for i in pack], self.device)
            # [positions, layers, 2, kv_heads, head_dim]: the indexed dims first, row by row.
            packed = cache.every[:, :, slot, :, at]
            for i, kv in zip(pack, packed.split([known[i] for i in pack]), strict=True):
                admission, completion, _ = rows[i]
                tokens = (*admission.prompt, *completion.tokens[:-1])
                given_up = functools.partial(dropped, admission) if dropped is not None else never_given_up
                entries.append((admission.keep, KeptKV(tokens, kv), given_up))
        kept.keep_all(entries)

    def _prefill_admissions(self, admissions: list[Admission], slots: list[int]) -> Tensor:
        """Prefill ``admissions`` into their ``slots`` (each admission the next ones, in order):
        those without kept keys and values together (`_prefill`), those with them together
        (`_extend`); the hidden states [len(slots), hidden] at each row's last prompt position."""
        if all(a.cached is None for a in admissions):
            return self._prefill([a.prompt for a in admissions], [len(a.limits) for a in admissions], slots)
        hidden = torch.empty(
            len(slots), self.model.config.hidden_size, dtype=self.cache.dtype, device=self.device
        )
        starts = [0]
        for a in admissions:
            starts.append(starts[-1] + len(a.limits))
        fresh = [i for i, a in enumerate(admissions) if a.cached is None]
        if fresh:
            rows = [r for i in fresh for r in range(starts[i], starts[i + 1])]
            hidden[_tensor_on(self.device, rows)] = self._prefill(
                [admissions[i].prompt for i in fresh],
                [len(admissions[i].limits) for i in fresh],
                [slots[r] for r in rows],
            )
        cached = [i for i, a in enumerate(admissions) if a.cached is not None]
        assert all(len(admissions[i].limits) == 1 for i in cached), "one row per admission with kept KV"
        hidden[_tensor_on(self.device, [starts[i] for i in cached])] = self._extend(
            [admissions[i] for i in cached], [slots[starts[i]] for i in cached]
        )
        return hidden

    def _extend(self, admissions: list[Admission], slots: list[int]) -> Tensor:
        """Restore each admission's kept keys and values (``cached``, its prompt's first tokens)
        into its slot's cache row, then prefill the rest of every prompt; the hidden states
        [len(admissions), hidden] at each prompt's last position. As `_prefill` bounds its
        forward passes, no pass takes more than `_PREFILL_TOKENS` tokens: rows go together
        (right-padded) as many as fit, and a row's new tokens longer than that (a long reply) go
        in pieces, each attending over the keys its row's earlier pieces wrote."""
        dev = self.device
        cache = self.cache
        kept = [a.cached for a in admissions if a.cached is not None]
        known = [len(c.tokens) for c in kept]
        new = [a.prompt[k:] for a, k in zip(admissions, known, strict=True)]
        # One write into every layer: [sum(known), layers, 2, kv_heads, D], as `_keep` gathered it.
        rows, at = _positions(slots, known, dev)
        cache.every[:, :, rows, :, at] = torch.cat([c.kv for c in kept])
        hidden_out = torch.empty(
            len(admissions), self.model.config.hidden_size, dtype=cache.dtype, device=dev
        )
        span = min(max(len(n) for n in new), _PREFILL_TOKENS)  # a pass's tokens a row, at most
        chunk = max(1, _PREFILL_TOKENS // span)
        for first in range(0, len(new), chunk):
            part = range(first, min(first + chunk, len(new)))
            for done in range(0, max(len(new[i]) for i in part), span):
                going = [i for i in part if done < len(new[i])]
                hidden = self._extend_pass(
                    [slots[i] for i in going],
                    [known[i] + done for i in going],
                    [new[i][done : done + span] for i in going],
                )
                last = [r for r, i in enumerate(going) if done + span >= len(new[i])]
                if last:
                    hidden_out[_tensor_on(dev, [going[r] for r in last])] = hidden[_tensor_on(dev, last)]
        return hidden_out

    def _extend_pass(self, slots: list[int], known: list[int], new: list[list[int]]) -> Tensor:
        """One forward pass of `_extend`: row i's tokens ``new[i]`` (right-padded) after the
        ``known[i]`` positions its cache row ``slots[i]`` holds; the hidden states [len(new),
        hidden] at each row's last new token."""
        dev = self.device
        m = self.model
        lengths = [len(n) for n in new]
        width = max(lengths)
        ids = _tensor_on(dev, [n + [0] * (width - len(n)) for n in new], torch.long)
        # A padding token takes its row's last position: in range, and it sees only that row's keys.
        positions = _tensor_on(
            dev, [[k + min(j, n - 1) for j in range(width)] for k, n in zip(known, lengths, strict=True)]
        )
        cos, sin = m.rotary(positions)
        attention = _Extend(self.cache, slots, known, lengths, positions)
        parts = compiled_layer_parts() if self.compiled and not self.eager_rounding else PLAIN_PARTS
        hidden = m.model.norm(m.run_layers(m.embed(ids, positions), cos, sin, attention, parts))
        return hidden[torch.arange(len(new), device=dev), _tensor_on(dev, lengths) - 1]

    def _prefill(self, prompts: list[list[int]], counts: list[int], slots: list[int]) -> Tensor:
        """Write each prompt's keys and values into its ``counts[i]`` cache rows (the next ones
        of ``slots``, in order); returns hidden states [len(slots), hidden] at each row's
        prompt's last position."""
        dev = self.device
        width = max(len(p) for p in prompts)
        m = self.model
        hidden_out = torch.empty(len(slots), m.config.hidden_size, dtype=self.cache.dtype, device=dev)
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        chunk = max(1, _PREFILL_TOKENS // width)
        compiled = self.compiled and not self.eager_rounding
        parts = compiled_layer_parts() if compiled else PLAIN_PARTS
        for first in range(0, len(prompts), chunk):
            part = range(first, min(first + chunk, len(prompts)))
            longest = max(len(prompts[i]) for i in part)
            ids = _tensor_on(dev, [prompts[i] + [0] * (longest - len(prompts[i])) for i in part], torch.long)
            # Each row of the part's prompts (an index into `slots`), and which prompt it takes.
            rows = _tensor_on(dev, [r for i in part for r in range(starts[i], starts[i + 1])])
            dest = _tensor_on(dev, [slots[r] for i in part for r in range(starts[i], starts[i + 1])])
            src = _tensor_on(dev, [i - first for i in part for _ in range(counts[i])])
            positions = torch.arange(longest, device=dev)
            cos, sin = m.rotary(positions)  # [T, 1, D]
            attention = _Prefill(self.cache, dest, src)
            hidden = m.model.norm(m.run_layers(m.embed(ids, positions), cos, sin, attention, parts))
            last = _tensor_on(dev, [len(prompts[i]) - 1 for i in part])
            hidden_out[rows] = hidden[src, last[src]]
        return hidden_out


def _positions(slots: list[int], lengths: list[int], device: torch.device) -> tuple[Tensor, Tensor]:
    """(cache row, position) of positions 0..lengths[i]-1 of each row ``slots[i]``, row by row:
    an index of a cache tensor's row and position dims."""
    counts = torch.tensor(lengths)
    rows = torch.repeat_interleave(torch.tensor(slots), counts)
    at = torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    return _copied_to(rows, device), _copied_to(at, device)


class _Prefill:
    """The prefill's `LayerAttention`: causal over each prompt of the part [U, T], writing
    prompt ``src[i]``'s keys and values into the cache's row ``dest[i]``."""

    def __init__(self, cache: KVCache, dest: Tensor, src: Tensor) -> None:
        self.cache, self.dest, self.src = cache, dest, src

    def writes(self, layer: int) -> None:
        return None

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        u, t = q.shape[:2]
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [U, kv_heads, T, D], the cache's layout
        self.cache.keys[layer][self.dest, :, :t] = k[self.src]
        self.cache.values[layer][self.dest, :, :t] = v[self.src]
        return attend(q.transpose(1, 2), k, v, None, True).transpose(1, 2).reshape(u, t, -1)


class _Extend:
    """`_extend`'s `LayerAttention`: rows [A, T] of new tokens (right-padded), row a's at
    ``positions[a]`` in cache row ``slots[a]`` after its ``known[a]`` restored keys and values.
    Each layer writes the real tokens' keys and values into their rows, then attends each token
    causally over its row's cache up to its own position."""

    def __init__(
        self, cache: KVCache, slots: list[int], known: list[int], lengths: list[int], positions: Tensor
    ) -> None:
        dev = positions.device
        self.cache = cache
        self.slots = _tensor_on(dev, slots)
        real = [(a, j) for a, n in enumerate(lengths) for j in range(n)]
        self.src = _tensor_on(dev, [a for a, _ in real])  # each real token's row ...
        self.col = _tensor_on(dev, [j for _, j in real])  # ... and column
        self.rows = self.slots[self.src]
        self.at = positions[self.src, self.col]
        self.end = max(k + n for k, n in zip(known, lengths, strict=True))
        keys = torch.arange(self.end, device=dev)
        self.mask = (keys <= positions.unsqueeze(-1)).unsqueeze(1)  # [A, 1, T, end]
        # Cache positions past a row's tokens are masked, yet enter attention's products: fresh
        # memory there may hold NaN (the decode step leaves it unzeroed), which a mask does not cancel.
        ends = _tensor_on(dev, [k + n for k, n in zip(known, lengths, strict=True)])
        self.beyond = (keys >= ends.unsqueeze(-1))[:, None, :, None]  # [A, 1, end, 1]

    def writes(self, layer: int) -> None:
        return None

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        a, t = q.shape[:2]
        keys, values = self.cache.keys[layer], self.cache.values[layer]
        keys[self.rows, :, self.at] = k[self.src, self.col]  # [tokens, kv_heads, D]
        values[self.rows, :, self.at] = v[self.src, self.col]
        row_keys = keys[self.slots, :, : self.end].masked_fill_(self.beyond, 0)  # [A, kv_heads, end, D]
        row_values = values[self.slots, :, : self.end].masked_fill_(self.beyond, 0)
        out = attend(q.transpose(1, 2), row_keys, row_values, self.mask, False)
        return out.transpose(1, 2).reshape(a, t, -1)


class _Live:
    """An admission in a loop: its slots, the step that recorded its first tokens, and its
    rows' Completions as they come back."""

    __slots__ = ("admission", "at", "out", "slots")

    def __init__(self, admission: Admission, slots: list[int], at: int) -> None:
        self.admission, self.slots, self.at = admission, slots, at
        self.out: list[Completion | None] = [None] * len(slots)


class _Slots:
    """A `serve` loop's host-side book of its slots: the live admissions and which rows of
    theirs still decode where, the free slots (lowest first), ``last``: the step by which
    every live row has reached its limit, and ``reach``: with the step count added, the
    positions an eager step reads."""

    def __init__(self, rows: int) -> None:
        self.free = list(range(rows))
        self.live: list[_Live] = []
        self.last = 0
        self.reach = 0

    def admit(self, admissions: list[Admission], count: int) -> list[int]:
        """Give each admission the lowest free slots, in order; all their slots."""
        taken: list[int] = []
        for admission in admissions:
            n = len(admission.limits)
            assert n <= len(self.free), "the source gave more rows than free slots"
            slots, self.free = self.free[:n], self.free[n:]
            self.live.append(_Live(admission, slots, count))
            taken += slots
        self._bounds()
        return taken

    def finished(self, done: list[bool], *, everything: bool) -> list[tuple[_Live, int, int]]:
        """(admission, row, slot) of each row still out that is ``done`` (or of every one)."""
        return [
            (live, row, slot)
            for live in self.live
            for row, slot in enumerate(live.slots)
            if live.out[row] is None and (everything or done[slot])
        ]

    def release(self, rows: list[tuple[_Live, int, int]]) -> list[_Live]:
        """Free the slots of ``rows`` (their Completions taken); the admissions now all back."""
        self.free = sorted(self.free + [slot for _, _, slot in rows])
        back = [live for live in self.live if all(c is not None for c in live.out)]
        self.live = [live for live in self.live if any(c is None for c in live.out)]
        self._bounds()
        return back

    def renumber(self, slots: dict[int, int], width: int) -> None:
        """The rows still out move to ``slots[old]``; the loop is ``width`` wide, the slots
        they do not take free."""
        for live in self.live:
            live.slots = [slots[s] if live.out[row] is None else -1 for row, s in enumerate(live.slots)]
        taken = set(slots.values())
        self.free = [slot for slot in range(width) if slot not in taken]

    def drop(self, dropped: Callable[[Admission], bool]) -> list[int]:
        """Forget the live admissions ``dropped`` says to; the slots their rows held, freed."""
        gone = [live for live in self.live if dropped(live.admission)]  # asked once: it may change
        freed = [slot for live in gone for row, slot in enumerate(live.slots) if live.out[row] is None]
        if gone:
            self.live = [live for live in self.live if not any(live is g for g in gone)]
            self.free = sorted(self.free + freed)
            self._bounds()
        return freed

    def _bounds(self) -> None:
        self.last = max((live.at + max(live.admission.limits) for live in self.live), default=0)
        self.reach = max((len(live.admission.prompt) - live.at for live in self.live), default=0)
