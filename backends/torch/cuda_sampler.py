"""A GPU sampler over a `Decoder`: batched prefill, one preallocated KV cache, decode steps
replayed from CUDA graphs, per-token logprobs. Same contract as `Sampler.generate`.

Layout. The KV cache is one flat buffer from a `KVPool`, viewed per layer as keys and values
[rows, kv_heads, length, head_dim]. Every row keeps its own tokens at positions 0..n-1 (no left
padding), so a decode step writes each row at its own position and attention reads the first
``position + 1`` keys of each row: on CUDA through flash attention's variable-length kernel
with ``seqused_k``, so one captured graph serves every step of a batch-size bucket (no
KV-length buckets, no masks). For flash, each (row, KV head) is one sequence of its g query
heads as g query positions (non-causal) over that head's keys, with one head: each row's keys
and values are read once per step rather than once per query head, and the queries, in the
model's head order, go into attention and its output into o_proj with no reordering.

Sampling. The graph also samples: with exponential noise E, ``argmax(softmax(logits / T) /
E)``, computed as ``argmax(logits / T - log E)``, is a draw from softmax(logits / T), and with
E = 1 it is the greedy choice. On CUDA the noise is made inside one Triton pass over the logits
(`race.race_draw`) from a seed drawn from the caller's generator before each replay; elsewhere
a noise tensor is drawn from it. Logprobs are those of the sampled token under log_softmax(logits / T),
temperature 1 for greedy, before any top-p truncation. With ``top_p < 1`` a second graph
stops at the logits and the caller draws from them eagerly.

Kernels. Prefill and decode run the model's own layers (`Decoder.run_layers`) with attention
objects over the pool (`_Prefill`, `_Decode`), reading the model's parameters where they are
(its fused q/k/v and gate/up projections: one GEMM each). With ``compiled`` the code between
attention calls runs as torch.compile'd kernels (norms, rotations with the cache write of the
new keys and values, residual adds, SwiGLU fused), captured into the graphs like any other
kernel, and so does the prefill's (`compiled_layer_parts`, which the trainer's `train.compile`
shares).

Colocation. Graphs read the model's parameter tensors in place: the trainer must update them
in place (optimizers do), never rebind them. `release` hands the KV cache's memory back to the
driver; `wake` maps it again at the same addresses, so the graphs stay valid. Where the pool
cannot keep addresses (`PlainPool`), `wake` drops the graphs and the next call captures them
again. On CPU (tests) the same code runs eagerly with SDPA and a length mask.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from backends.torch import race
from backends.torch.attention import attend
from backends.torch.kv_pool import KVPool, make_pool
from backends.torch.model import (
    PLAIN_PARTS,
    Decoder,
    DecoderLayer,
    compiled_layer_parts,
    layer_finish,
    layer_project,
)
from backends.torch.sampling import check_arguments, completions_of_rows, draw
from pipeline.messages import Completion

_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)
# Tokens of the prefill forward at once (bounds prefill activation memory).
_PREFILL_TOKENS = 32768


def _bucket(n: int) -> int:
    for b in _BUCKETS:
        if b >= n:
            return b
    return -(-n // _BUCKETS[-1]) * _BUCKETS[-1]


_FLASH_WORKS: dict[torch.device, bool] = {}


def _flash_works(device: torch.device) -> bool:
    """Whether this torch build has variable-length flash attention with ``seqused_k``."""
    if device not in _FLASH_WORKS:
        try:
            q = torch.zeros(2, 1, 64, dtype=torch.bfloat16, device=device)
            cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
            used = torch.ones(2, dtype=torch.int32, device=device)
            torch.ops.aten._flash_attention_forward(q, q, q, cu, cu, 1, 1, 0.0, False, False, seqused_k=used)
            _FLASH_WORKS[device] = True
        except (RuntimeError, TypeError, NotImplementedError):
            _FLASH_WORKS[device] = False
    return _FLASH_WORKS[device]


class _Step:
    """Static buffers of one decode step over ``rows`` rows, and its captured graph. A step
    that ``draws`` samples in the graph (on CUDA with `race_draw`, from ``seed``, as ``noisy``
    says; elsewhere from ``noise``); one that does not leaves logits / T in ``logits`` for the
    caller to draw from."""

    def __init__(
        self,
        rows: int,
        draws: bool,
        vocab: int,
        length: int,
        kv_heads: int,
        group: int,
        pool_rows: int,
        device: torch.device,
    ) -> None:
        self.rows = rows
        self.draws = draws
        self.token = torch.zeros(rows, dtype=torch.long, device=device)
        self.position = torch.zeros(rows, dtype=torch.long, device=device)
        shape = (rows, vocab)
        self.race = draws and race.available(device)
        self.noise = torch.ones(shape if draws and not self.race else (), dtype=torch.float32, device=device)
        self.seed = torch.zeros((), dtype=torch.long, device=device)
        self.noisy = torch.ones((), dtype=torch.float32, device=device)
        self.logits = torch.empty(() if draws else shape, dtype=torch.float32, device=device)
        self.inv_temperature = torch.ones((), dtype=torch.float32, device=device)
        self.logprob = torch.empty(rows, dtype=torch.float32, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        # Where each (row, KV head)'s keys, then its values, start in a layer's
        # `CudaSampler._kv`; flash's variable-length offsets: per (row, KV head) g query
        # "positions" and `length` keys.
        sequences = rows * kv_heads
        base = torch.arange(sequences, device=device) * length
        self.kv_base = torch.cat((base, base + pool_rows * kv_heads * length))
        self.cu_q = torch.arange(0, (sequences + 1) * group, group, dtype=torch.int32, device=device)
        self.cu_k = torch.arange(0, (sequences + 1) * length, length, dtype=torch.int32, device=device)


class CudaSampler:
    """Generates completions with a KV cache and (on CUDA) CUDA-graph decode steps.

    ``graphs``: capture decode steps (CUDA only). ``flash``: variable-length flash attention
    for decode (CUDA only; otherwise SDPA with a key mask). ``compiled`` (default: when
    capturing graphs): the parts of a step between attention calls run as torch.compile'd
    (inductor) kernels, which fuse the norms, rotations, residual adds, SwiGLU and sampling
    into few launches, and so do the prefill's layers. The pool grows to the largest bucketed
    batch and length seen; growing it drops and re-captures the graphs.

    Rounding. Compiled kernels keep float32 intermediates where eager ops round to bf16; the
    engine's logprobs agree best with a trainer that rounds the same way. By default the
    engine rounds as compiled kernels do (`train.compile`'s trainer); ``eager_rounding``
    rounds as eager ops do, for a trainer without it: decode parts emulate eager's casts
    (`emulate_precision_casts`) and the prefill runs its layers uncompiled. Measured on the
    H200 in `bench/results-h200.json`, session_2026-11-29e.
    """

    def __init__(
        self,
        model: Decoder,
        *,
        graphs: bool = True,
        flash: bool = True,
        compiled: bool | None = None,
        eager_rounding: bool = False,
        pool: KVPool | None = None,
        check_every: int = 32,
    ) -> None:
        param = next(model.parameters())
        self.model = model
        self.device = param.device
        self.dtype = param.dtype
        cuda = self.device.type == "cuda"
        self.graphs = graphs and cuda
        # Flash attention takes half precision only.
        self.flash = (
            flash and cuda and self.dtype in (torch.bfloat16, torch.float16) and _flash_works(self.device)
        )
        self.check_every = check_every
        self.compiled = self.graphs if compiled is None else compiled
        self.eager_rounding = eager_rounding
        parts = (_prologue, _project, _finish, _draw, _scaled_logits, _head)
        if self.compiled:
            # The first batch-size bucket gets kernels for its shapes, a second one kernels for
            # any number of rows (dynamo's automatic dynamic shapes), so buckets never exhaust
            # its recompile limit; past that limit (other dtypes, models) a part runs uncompiled.
            options = {"emulate_precision_casts": True} if eager_rounding else {}
            parts = tuple(torch.compile(f, options=options) for f in parts)
        (
            self._prologue,
            self._project,
            self._finish,
            self._draw,
            self._scaled_logits,
            self._head,
        ) = parts
        c = model.config
        self.kv_heads, self.head_dim = c.num_key_value_heads, c.head_dim
        self.group = c.num_attention_heads // c.num_key_value_heads
        self.vocab = c.vocab_size
        self.pool = pool if pool is not None else make_pool(self.device)
        self.rows = 0
        self.length = 0
        self._keys: list[Tensor] = []
        self._values: list[Tensor] = []
        self._kv: list[Tensor] = []
        self._steps: dict[tuple[int, bool], _Step] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self._down = False
        self.captures = 0

    # ---- memory and handoff -------------------------------------------------------------

    def cache_bytes(self) -> int:
        """Device bytes the pool holds now: the KV cache (0 while stood down or before the
        first call)."""
        return self.pool.resident_bytes

    def release(self) -> None:
        """Stand down: free the KV cache's memory; graphs are kept for `wake`."""
        if self.rows and not self._down:
            self.pool.release()
            self._down = True

    @torch.no_grad()
    def wake(self) -> None:
        """Map the KV cache again (same addresses where the pool allows; otherwise the graphs
        are dropped and captured again on the next call)."""
        if not self._down:
            return
        buffer = self.pool.restore()
        self._down = False
        if not self.pool.stable:
            self._view(buffer)
            self._drop_graphs()
        self._clear_for_masks()

    def _ensure(self, rows: int, length: int) -> None:
        if self._down:
            self.wake()
        if rows <= self.rows and length <= self.length:
            return
        rows, length = max(rows, self.rows), max(length, self.length)
        self._drop_graphs()
        self._keys, self._values, self._kv = [], [], []
        elements = 2 * self.model.config.num_hidden_layers * rows * self.kv_heads * length * self.head_dim
        # Ordinary tensors, though `generate` runs in inference mode: the pool's views outlive
        # the call, and `wake` clears them in place outside it.
        with torch.inference_mode(False):
            buffer = self.pool.allocate(elements * torch.finfo(self.dtype).bits // 8)
            self.rows, self.length = rows, length
            self._view(buffer)
        self._clear_for_masks()

    def _drop_graphs(self) -> None:
        """Forget every step and its graph. The next captures take a new private memory pool:
        the caching allocator lets a capture share a pool only while a graph that uses it is
        alive (it asserts `use_count > 0` in `beginAllocateToPool` otherwise), and the pool of
        graphs just destroyed lingers while its cached blocks are not yet freed."""
        self._steps.clear()
        if self.graphs:
            self._graph_pool = torch.cuda.graph_pool_handle()

    def _clear_for_masks(self) -> None:
        """Zero fresh keys and values where attention masks them rather than not reading them
        (SDPA, not flash): masked positions still enter its products, and uninitialised
        memory may hold NaN, which a mask does not cancel (0 * NaN is NaN)."""
        if not self.flash:
            for tensor in (*self._keys, *self._values):
                tensor.zero_()

    def _view(self, buffer: Tensor) -> None:
        """Each layer's keys and values in the pool's buffer, adjacent: one index_copy_ writes
        both (`layer_project`)."""
        shape = (self.rows, self.kv_heads, self.length, self.head_dim)
        per = math.prod(shape)
        flat = buffer.view(self.dtype)
        layers = self.model.config.num_hidden_layers
        self._kv = [flat[2 * i * per : (2 * i + 2) * per].view(-1, self.head_dim) for i in range(layers)]
        self._keys = [both[: per // self.head_dim].view(shape) for both in self._kv]
        self._values = [both[per // self.head_dim :].view(shape) for both in self._kv]

    # ---- generation ---------------------------------------------------------------------

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] = (),
        generator: torch.Generator,
    ) -> list[Completion]:
        """As `Sampler.generate`; randomness comes from ``generator`` (on the sampler's device)."""
        check_arguments(
            prompts, max_new_tokens, temperature, top_p, max_positions=self.model.config.position_limit
        )
        if not prompts:
            return []
        lengths = [len(p) for p in prompts]
        batch = len(prompts)
        rows = _bucket(batch)
        self._ensure(rows, max(lengths) + max_new_tokens)
        dev = self.device
        greedy = temperature == 0
        step = self._step(rows, draws=greedy or top_p == 1)

        hidden = self._prefill(prompts, rows)
        step.position[:batch] = torch.tensor(lengths, device=dev)
        step.position[batch:] = 0
        step.inv_temperature.fill_(1.0 if greedy else 1.0 / temperature)
        step.noisy.fill_(0.0 if greedy else 1.0)
        if greedy and step.draws and not step.race:
            step.noise.fill_(1.0)

        stop = torch.tensor(list(stop_token_ids), dtype=torch.long, device=dev)
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
            token, logprob = draw(self._logits(hidden), temperature, top_p, generator)
        count = 0
        early: _HostColumns | None = None
        while True:
            tokens[:, count] = token
            logprobs[:, count] = logprob
            if stop.numel():  # without stop tokens every row generates `count`
                generated += ~done
                done |= torch.isin(token, stop)
            count += 1
            if count == max_new_tokens:
                break
            if count == max_new_tokens - _HOST_TAIL and self.device.type == "cuda":
                early = _HostColumns(tokens[:batch, :count], logprobs[:batch, :count])
            if stop.numel() and count % self.check_every == 0 and bool(done.all()):
                break
            if token is not step.token:
                step.token.copy_(token)
            if step.draws and not greedy:
                if step.race:
                    step.seed.random_(generator=generator)
                else:
                    step.noise.exponential_(generator=generator)
            self._replay(step)
            step.position += 1
            if step.draws:
                # Read (by the copies above) before the next replay overwrites them.
                token, logprob = step.token, step.logprob
            else:
                # step.logits holds logits / temperature.
                token, logprob = draw(step.logits, 1.0, top_p, generator)

        if not stop.numel():
            generated.fill_(count)
        # The early columns were copied while the last steps ran; they become lists while the
        # GPU decodes the tail (about a quarter second), then only the tail is converted.
        head_tokens, head_logprobs = early.lists() if early else ([[]] * batch, [[]] * batch)
        start = early.columns if early else 0
        tail_tokens = tokens[:batch, start:count].tolist()
        tail_logprobs = logprobs[:batch, start:count].tolist()
        return completions_of_rows(
            generated[:batch].tolist(),
            [a + b for a, b in zip(head_tokens, tail_tokens, strict=True)],
            [a + b for a, b in zip(head_logprobs, tail_logprobs, strict=True)],
            stop_token_ids,
        )

    def _logits(self, hidden: Tensor) -> Tensor:
        return self.model.lm_head(hidden).float()

    # ---- prefill ------------------------------------------------------------------------

    def _prefill(self, prompts: list[list[int]], rows: int) -> Tensor:
        """Fill the cache for every prompt; returns hidden states [rows, hidden] at each
        prompt's last position (zeros for padding rows)."""
        dev = self.device
        unique_index: dict[tuple[int, ...], int] = {}
        row_to_unique = [unique_index.setdefault(tuple(p), len(unique_index)) for p in prompts]
        unique = list(unique_index)
        width = max(len(p) for p in unique)
        hidden_out = torch.zeros(rows, self.model.config.hidden_size, dtype=self.dtype, device=dev)
        chunk = max(1, _PREFILL_TOKENS // width)
        for first in range(0, len(unique), chunk):
            part = unique[first : first + chunk]
            ids = torch.tensor([list(p) + [0] * (width - len(p)) for p in part], dtype=torch.long, device=dev)
            last = torch.tensor([len(p) - 1 for p in part], device=dev)
            # Rows of the batch whose prompt is in this part, and which of the part each takes.
            targets = [(r, u - first) for r, u in enumerate(row_to_unique) if first <= u < first + len(part)]
            dest = torch.tensor([r for r, _ in targets], device=dev)
            src = torch.tensor([u for _, u in targets], device=dev)
            hidden = self._prefill_forward(ids, dest, src)
            hidden_out[dest] = hidden[src, last[src]]
        return hidden_out

    def _prefill_forward(self, ids: Tensor, dest: Tensor, src: Tensor) -> Tensor:
        """Right-padded causal forward of ``ids`` [U, T]; writes keys/values of unique row
        ``src[i]`` into cache row ``dest[i]``. Padding comes after the real tokens, so causal
        attention keeps it out of their reach and decode overwrites it."""
        m = self.model
        positions = torch.arange(ids.shape[1], device=ids.device)
        cos, sin = m.rotary(positions)  # [T, 1, D]
        compiled = self.compiled and not self.eager_rounding
        parts = compiled_layer_parts() if compiled else PLAIN_PARTS
        attention = _Prefill(self._keys, self._values, dest, src)
        return m.model.norm(m.run_layers(m.embed(ids, positions), cos, sin, attention, parts))

    # ---- decode -------------------------------------------------------------------------

    def _step(self, rows: int, *, draws: bool) -> _Step:
        step = self._steps.get((rows, draws))
        if step is None:
            with torch.inference_mode(False):  # kept between calls, as the pool's views are
                step = _Step(
                    rows, draws, self.vocab, self.length, self.kv_heads, self.group, self.rows, self.device
                )
            self._steps[rows, draws] = step
        return step

    def _replay(self, step: _Step) -> None:
        if not self.graphs:
            self._decode(step)
            return
        if step.graph is None:
            self._capture(step)
        assert step.graph is not None
        step.graph.replay()

    def _capture(self, step: _Step) -> None:
        saved = (step.token.clone(), step.position.clone(), step.noise.clone())
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside capture (compilation, kernel selection, workspaces)
                self._decode(step)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # Thread-local: a trainer working in another thread (not colocated) must not trip it.
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            self._decode(step)
        step.graph = graph
        self.captures += 1
        step.token.copy_(saved[0])
        step.position.copy_(saved[1])
        step.noise.copy_(saved[2])
        # The warm-ups wrote keys/values at the current positions: the replay rewrites them.

    def _decode(self, step: _Step) -> None:
        """One decode step over all of ``step.rows``: reads token/position, writes the cache at
        each row's position, and leaves the sampled token and its logprob in
        ``step.token``/``step.logprob`` (a step that draws) or logits / T in ``step.logits``."""
        m = self.model
        x, cos, sin, write, used = self._prologue(m, step.token, step.position, step.kv_base, self.kv_heads)
        attention = _Decode(self, step, write, used)
        x = m.run_layers(x, cos, sin, attention, (self._project, self._finish))
        if step.race:
            race.race_draw(
                self._head(m, x), step.inv_temperature, step.seed, step.noisy, out=(step.token, step.logprob)
            )
        elif step.draws:
            token, logprob = self._draw(m, x, step.inv_temperature, step.noise)
            step.token.copy_(token)
            step.logprob.copy_(logprob)
        else:
            self._scaled_logits(m, x, step.inv_temperature, step.logits)



class _Prefill:
    """The prefill's `LayerAttention`: causal over each row of the batch [U, T], writing row
    ``src[i]``'s keys and values into the pool's row ``dest[i]``."""

    def __init__(self, keys: list[Tensor], values: list[Tensor], dest: Tensor, src: Tensor) -> None:
        self.keys, self.values, self.dest, self.src = keys, values, dest, src

    def writes(self, layer: int) -> None:
        return None

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        u, t = q.shape[:2]
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [U, kv_heads, T, D], the pool's layout
        self.keys[layer][self.dest, :, :t] = k[self.src]
        self.values[layer][self.dest, :, :t] = v[self.src]
        return attend(q.transpose(1, 2), k, v, None, True).transpose(1, 2).reshape(u, t, -1)


class _Decode:
    """A decode step's `LayerAttention`: one new query per row over its first ``position + 1``
    keys in the pool; `layer_project` writes the new keys and values at ``write`` (`_prologue`).
    Grouped-query attention as in the module docstring: for flash, each (row, KV head) is a
    sequence of g query positions; elsewhere `attend` with a length mask."""

    def __init__(self, sampler: CudaSampler, step: _Step, write: Tensor, used: Tensor) -> None:
        self.sampler, self.step, self.write, self.used = sampler, step, write, used

    def writes(self, layer: int) -> tuple[Tensor, Tensor]:
        return self.sampler._kv[layer], self.write

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        sampler, step = self.sampler, self.step
        rows, length, d = step.rows, sampler.length, sampler.head_dim
        keys, values = sampler._keys[layer][:rows], sampler._values[layer][:rows]
        if sampler.flash:
            return torch.ops.aten._flash_attention_forward(
                q.view(-1, 1, d),
                keys.view(-1, 1, d),
                values.view(-1, 1, d),
                step.cu_q,
                step.cu_k,
                sampler.group,
                length,
                0.0,
                False,
                False,
                seqused_k=self.used,
            )[0].view(rows, -1)
        mask = torch.arange(length, device=q.device) < self.used.view(rows, -1)[:, :1]
        return attend(q.unsqueeze(2), keys, values, mask[:, None, None, :], False).view(rows, -1)


# Decode steps left when the tokens so far start their copy to the host (`_HostColumns`).
_HOST_TAIL = 64


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


# The parts of a decode step around the layers, as plain functions (not methods) so that one
# torch.compile'd version serves every call.


def _prologue(
    model: Decoder, token: Tensor, position: Tensor, kv_base: Tensor, kv_heads: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A step's inputs to every layer: embeddings, rotary cos/sin [rows, 1, D], where each
    (row, KV head)'s new key and value go in a layer's flat keys-then-values (``kv_base`` +
    position, keys then values), and how many keys each (row, KV head) attends over (int32)."""
    cos, sin = model.rotary(position)
    per_head = position.unsqueeze(1).expand(-1, kv_heads).reshape(-1)
    write = kv_base + torch.cat((per_head, per_head))
    return model.embed(token, position), cos, sin, write, (per_head + 1).to(torch.int32)


# The layers' parts in their own code objects, so that torch.compile's versions of them for the
# decode step (other options, other shapes) never count against the recompile limit of the
# trainer's `compiled_layer_parts`.


def _project(
    layer: DecoderLayer, x: Tensor, cos: Tensor, sin: Tensor, writes: tuple[Tensor, Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    return layer_project(layer, x, cos, sin, writes)


def _finish(layer: DecoderLayer, x: Tensor, out: Tensor) -> Tensor:
    return layer_finish(layer, x, out)


def _draw(model: Decoder, x: Tensor, inv_temperature: Tensor, noise: Tensor) -> tuple[Tensor, Tensor]:
    """Final norm, logits / T, and the draw argmax(softmax / noise), taken as
    argmax(logits / T - log noise) (one pass, no softmax), with its logprob."""
    scaled = model.lm_head(model.model.norm(x)).float() * inv_temperature
    token = (scaled - noise.log()).argmax(dim=-1)
    picked = scaled.gather(-1, token.unsqueeze(-1)).squeeze(-1)
    return token, picked - torch.logsumexp(scaled, dim=-1)


def _head(model: Decoder, x: Tensor) -> Tensor:
    """Final norm and logits, in the model's dtype."""
    return model.lm_head(model.model.norm(x))


def _scaled_logits(model: Decoder, x: Tensor, inv_temperature: Tensor, out: Tensor) -> None:
    """Final norm and logits / T, written to ``out``."""
    out.copy_(model.lm_head(model.model.norm(x)).float() * inv_temperature)
