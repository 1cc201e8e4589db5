"""The sampler: completions with per-token logprobs for batches of ``(prompt, n)`` requests,
over a `Decoder`, on any device.

`Sampler.generate` gives each request n rows of the batch. The prefill runs each request's
prompt once (right-padded, causal: padding never reaches a real token) and writes its keys
and values into each of its rows of the `KVCache`; the first token of every row is drawn from
the prefill's last hidden state, and each further one by a decode step (`decode_step.py`:
replayed from a CUDA graph on a GPU, eager elsewhere). Each `Completion`'s ``logprobs[i]`` is
log_softmax(logits / T)[tokens[i]] before any top-p truncation (temperature 1 when greedy); a
stop token, when hit, is the last token. All randomness comes from the caller's generator, on
the sampler's device: equal generator state and inputs give equal outputs.

Rows. With graphs (or compiled parts) a batch is padded to a bucket of rows (`_BUCKETS`) so few
shapes are captured or compiled; the cache grows to the largest bucket and length seen, and
growing it drops the steps and their graphs. Eager (CPU), a batch has exactly its rows.

Rounding. Compiled kernels keep float32 intermediates where eager ops round to bf16; the
engine's logprobs agree best with a trainer that rounds the same way. By default the sampler
rounds as compiled kernels do (`train.compile`'s trainer); ``eager_rounding`` rounds as eager
ops do, for a trainer without it: decode parts emulate eager's casts and the prefill runs its
layers uncompiled. Compiled, the prefill shares the trainer's `compiled_layer_parts`.

Colocation. The steps read the model's parameter tensors in place: the trainer must update
them in place (optimizers do), never rebind them. `release` hands the cache's memory back to
the driver; `wake` maps it again, at the same addresses where the pool allows (the graphs stay
valid), else the graphs are dropped and captured again on the next call.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from torch import Tensor

from backends.torch import race
from backends.torch.attention import attend
from backends.torch.decode_step import DecodeSteps, flash_works
from backends.torch.kv_cache import KVCache
from backends.torch.kv_pool import KVPool, make_pool
from backends.torch.model import PLAIN_PARTS, Decoder, compiled_layer_parts
from backends.torch.sampling import check_arguments, completions, draw
from pipeline.messages import Completion

_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)
# Tokens of the prefill forward at once (bounds prefill activation memory).
_PREFILL_TOKENS = 32768
# Decode steps left when the tokens so far start their copy to the host (`_HostColumns`).
_HOST_TAIL = 64


def _bucket(n: int) -> int:
    for b in _BUCKETS:
        if b >= n:
            return b
    return -(-n // _BUCKETS[-1]) * _BUCKETS[-1]


class Sampler:
    """``graphs``: capture decode steps (CUDA only). ``flash``: variable-length flash attention
    for decode (CUDA in half precision only; otherwise `attend` with a length mask).
    ``compiled`` (default: when capturing graphs): torch.compile'd parts around attention, for
    decode and prefill. ``check_every``: decode steps between checks that every row has
    stopped (each check waits for the device; default 32 on CUDA, 1 elsewhere)."""

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

    @property
    def captures(self) -> int:
        """CUDA graphs captured so far."""
        return self.steps.captures

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
        unused).

        ``limits``: one per row (the requests' rows in order): row i ends after ``limits[i]``
        tokens (finish_reason "length") unless a stop token ends it first; the limits are a
        tensor compared on the device at each step, and a finished row's position stays put, so
        the cache needs only each row's prompt plus its own limit. ``freeze``: a host flag read
        at each step boundary; once set, the call returns at once, the rows that had not
        finished with finish_reason "frozen" and their tokens so far (partial rollouts).
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
        batch = sum(counts)
        if not batch:
            return [[] for _ in requests]
        lengths = [len(p) for p in prompts]
        rows = _bucket(batch) if self._bucketed else batch
        bounds = limits if limits is not None else [max_new_tokens] * batch
        self._ensure(rows, max(len(p) + b for p, b in zip(row_prompts, bounds, strict=True)))
        dev = self.device
        greedy = temperature == 0
        step = self.steps.get(rows, draws=greedy or top_p == 1)

        hidden = self._prefill(prompts, counts, rows)
        row_lengths = [length for length, n in zip(lengths, counts, strict=True) for _ in range(n)]
        step.position[:batch] = torch.tensor(row_lengths, device=dev)
        step.position[batch:] = 0
        step.inv_temperature.fill_(1.0 if greedy else 1.0 / temperature)
        step.noisy.fill_(0.0 if greedy else 1.0)
        if greedy and step.draws and not step.race:
            step.noise.fill_(1.0)

        stop = torch.tensor(list(stop_token_ids), dtype=torch.long, device=dev)
        limit = None
        if limits is not None:
            limit = torch.full((rows,), max_new_tokens, dtype=torch.long, device=dev)
            limit[:batch] = torch.tensor(list(limits), device=dev)
        ends = bool(stop.numel()) or limit is not None  # rows may finish before max_new_tokens
        tokens = torch.empty(rows, max_new_tokens, dtype=torch.long, device=dev)
        logprobs = torch.empty(rows, max_new_tokens, dtype=torch.float32, device=dev)
        generated = torch.zeros(rows, dtype=torch.long, device=dev)
        done = torch.zeros(rows, dtype=torch.bool, device=dev)
        done[batch:] = True

        # The first token comes from the prefill's hidden states, outside the graphs.
        if step.race:
            step.seed.random_(generator=generator)
            token, logprob = race.race_draw(
                self.model.lm_head(hidden), step.inv_temperature, step.seed, step.noisy
            )
        else:
            token, logprob = draw(self.model.lm_head(hidden).float(), temperature, top_p, generator)
        count = 0
        frozen = False
        early: _HostColumns | None = None
        while True:
            tokens[:, count] = token
            logprobs[:, count] = logprob
            if ends:  # otherwise every row generates `count`
                generated += ~done
                if stop.numel():
                    done |= torch.isin(token, stop)
                if limit is not None:
                    done |= generated >= limit
            count += 1
            if count == max_new_tokens:
                break
            if count == max_new_tokens - _HOST_TAIL and dev.type == "cuda":
                early = _HostColumns(tokens[:batch, :count], logprobs[:batch, :count])
            if ends and count % self.check_every == 0 and bool(done.all()):
                break
            if freeze is not None and freeze.is_set():  # a host flag: no device sync
                frozen = True
                break
            if token is not step.token:
                step.token.copy_(token)
            if step.draws and not greedy:
                if step.race:
                    step.seed.random_(generator=generator)
                else:
                    step.noise.exponential_(generator=generator)
            self.steps.run(step, min(max(lengths) + count, self.cache.length))
            # A finished row's position stays put, inside its prompt plus its own limit.
            step.position += 1 if limit is None else ~done
            if step.draws:
                # Read (by the copies above) before the next replay overwrites them.
                token, logprob = step.token, step.logprob
            else:
                # step.logits holds logits / temperature.
                token, logprob = draw(step.logits, 1.0, top_p, generator)

        if not ends:
            generated.fill_(count)
        # The early columns were copied while the last steps ran; they become lists while the
        # GPU decodes the tail (about a quarter second), then only the tail is converted.
        head_tokens, head_logprobs = early.lists() if early else ([[]] * batch, [[]] * batch)
        start = early.columns if early else 0
        tail_tokens = tokens[:batch, start:count].tolist()
        tail_logprobs = logprobs[:batch, start:count].tolist()
        flat = completions(
            generated[:batch].tolist(),
            [a + b for a, b in zip(head_tokens, tail_tokens, strict=True)],
            [a + b for a, b in zip(head_logprobs, tail_logprobs, strict=True)],
            stop_token_ids,
            (~done[:batch]).tolist() if frozen else None,
        )
        out, first = [], 0
        for n in counts:
            out.append(flat[first : first + n])
            first += n
        return out

    def _prefill(self, prompts: list[list[int]], counts: list[int], rows: int) -> Tensor:
        """Fill the cache for every request's rows; returns hidden states [rows, hidden] at
        each row's prompt's last position (zeros for padding rows)."""
        dev = self.device
        width = max(len(p) for p in prompts)
        m = self.model
        hidden_out = torch.zeros(rows, m.config.hidden_size, dtype=self.cache.dtype, device=dev)
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        chunk = max(1, _PREFILL_TOKENS // width)
        compiled = self.compiled and not self.eager_rounding
        parts = compiled_layer_parts() if compiled else PLAIN_PARTS
        for first in range(0, len(prompts), chunk):
            part = range(first, min(first + chunk, len(prompts)))
            longest = max(len(prompts[i]) for i in part)
            ids = torch.tensor(
                [prompts[i] + [0] * (longest - len(prompts[i])) for i in part], dtype=torch.long, device=dev
            )
            # Each row of the batch whose prompt is in this part, and which of the part it takes.
            dest = torch.tensor([r for i in part for r in range(starts[i], starts[i + 1])], device=dev)
            src = torch.tensor([i - first for i in part for _ in range(counts[i])], device=dev)
            positions = torch.arange(longest, device=dev)
            cos, sin = m.rotary(positions)  # [T, 1, D]
            attention = _Prefill(self.cache, dest, src)
            hidden = m.model.norm(m.run_layers(m.embed(ids, positions), cos, sin, attention, parts))
            last = torch.tensor([len(prompts[i]) - 1 for i in part], device=dev)
            hidden_out[dest] = hidden[src, last[src]]
        return hidden_out


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


class _HostColumns:
    """The first columns of a call's tokens and logprobs, copied to pinned host memory without
    waiting, so that turning them into Python lists overlaps the GPU's last decode steps."""

    def __init__(self, tokens: Tensor, logprobs: Tensor) -> None:
        self.columns = tokens.shape[1]
        self.tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        self.logprobs = torch.empty(logprobs.shape, dtype=logprobs.dtype, pin_memory=True)
        self.tokens.copy_(tokens, non_blocking=True)
        self.logprobs.copy_(logprobs, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()

    def lists(self) -> tuple[list[list[int]], list[list[float]]]:
        self.copied.synchronize()
        return self.tokens.tolist(), self.logprobs.tolist()
