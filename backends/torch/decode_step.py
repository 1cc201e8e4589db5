"""The sampler's decode step: one new token for every row of a batch, through the model's own
layer parts (`layer_project`, `layer_finish`) over the `KVCache`, replayed from a CUDA graph on a
GPU.

A `DecodeStep` holds one batch-size bucket's static buffers (token, position, noise, logits)
and its captured graph; `DecodeSteps` makes them, captures and replays them, and forgets them
all when the cache is laid out anew (`drop`).

Attention (`_Decode`): one query per row over its first ``position + 1`` keys. On CUDA in half
precision (where flash attention works, ``flash``) with Triton, by `paged_decode`'s kernels,
each cache row one block of its keys: one program a (row, KV head, split) reads the row's keys
once for the g query heads that share them, each row's keys split in equal shares over a number
of programs that follows from the bucket and the cache's length alone (`paged_decode.splits`),
so one captured graph serves every step of a bucket (no KV-length buckets, no masks) and rows
of unequal lengths still spread over the device. Head dims
those kernels do not take (and CUDA without Triton) attend by flash attention's variable-length
kernel with ``seqused_k``: each (row, KV head) one sequence of its g query heads as g query
positions (non-causal) over that head's keys. On an H200 the Triton kernels ran faster at every
width from 8 to 256 rows (bench/results-h200.json, session_2026-12-04). Elsewhere `attend` with
a length mask, over the keys written so far (``span``) when no graph fixes the shapes.

Sampling in the step: with exponential noise E, ``argmax(softmax(logits / T) / E)``, computed
as ``argmax(logits / T - log E)``, is a draw from softmax(logits / T), and with E = 1 it is the
greedy choice. On CUDA the noise is made inside one Triton pass over the logits
(`race.race_draw`) from a seed the caller draws before each replay; elsewhere a noise tensor is
drawn. A step that does not draw (top-p) leaves logits / T for the caller.

Kernels. With ``compiled`` the parts around attention (norms, projections, rotations with the
cache write of the new keys and values, residual adds, SwiGLU, the head and the draw) run as
torch.compile'd kernels, captured into the graphs like any other kernel. Where the residual
stream is float32 (`Decoder.residual_dtype`, or float32 parameters), one compiled part runs
between two layers' attentions (`_between`: the first layer's finish and the next one's
projection), so that a layer's last residual add and the next one's input norm are one kernel;
in a half-precision stream that kernel would feed the norm the sum unrounded (inductor keeps a
kernel's intermediates in float32), where the trainer's and the prefill's parts round it.
``eager_rounding`` compiles them with `emulate_precision_casts`, for a trainer whose kernels
round as eager ops do. Graphs read the model's parameters and the cache in place: the trainer
must update the parameters in place (optimizers do), and the cache must keep its addresses
(`KVPool.stable`) or its graphs be dropped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from backends.torch import paged_decode, race
from backends.torch.attention import attend
from backends.torch.kv_cache import KVCache
from backends.torch.model import Decoder, DecoderLayer, layer_finish, layer_project

_FLASH_WORKS: dict[torch.device, bool] = {}


def flash_works(device: torch.device) -> bool:
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


class DecodeStep:
    """Static buffers of one decode step over ``rows`` rows, and its captured graph. A step
    that ``draws`` samples in the step (on CUDA with `race_draw`, from ``seed``, as ``noisy``
    says; elsewhere from ``noise``) into ``token`` and ``logprob``; one that does not leaves
    logits / T in ``logits`` for the caller to draw from."""

    def __init__(
        self, rows: int, draws: bool, vocab: int, cache: KVCache, group: int, device: torch.device
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
        # Where each (row, KV head)'s keys, then its values, start in a layer's `KVCache.flat`;
        # flash's variable-length offsets: per (row, KV head) g queries and `length` keys.
        sequences, length = rows * cache.kv_heads, cache.length
        base = torch.arange(sequences, device=device) * length
        self.kv_base = torch.cat((base, base + cache.rows * cache.kv_heads * length))
        self.cu_q = torch.arange(0, (sequences + 1) * group, group, dtype=torch.int32, device=device)
        self.cu_k = torch.arange(0, (sequences + 1) * length, length, dtype=torch.int32, device=device)
        # `paged_decode`'s block table: each row's keys are one block of the cache's length.
        self.table = torch.arange(rows, dtype=torch.int32, device=device).view(rows, 1)


class DecodeSteps:
    """The decode steps of a sampler over ``cache``: ``graphs`` (CUDA only) captures each
    step once and replays it; ``flash`` and ``compiled`` as in the module docstring."""

    def __init__(
        self,
        model: Decoder,
        cache: KVCache,
        *,
        graphs: bool,
        flash: bool,
        compiled: bool,
        eager_rounding: bool,
    ) -> None:
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device
        self.graphs = graphs
        self.flash = flash
        # Steps attend by `paged_decode`, each row's keys split over programs, where its kernels
        # take the head dim; flash takes the others.
        self.split_keys = paged_decode.triton is not None and paged_decode.takes_head_dim(cache.head_dim)
        c = model.config
        self.group = c.num_attention_heads // c.num_key_value_heads
        parts: tuple[Any, ...] = (_prologue, _project, _finish, _between, _draw, _scaled_logits, _head)
        if compiled:
            # The first batch-size bucket gets kernels for its shapes, a second one kernels for
            # any number of rows (dynamo's automatic dynamic shapes), so buckets never exhaust
            # its recompile limit; past that limit (other dtypes, models) a part runs uncompiled.
            options: dict[str, Any] = {"emulate_precision_casts": True} if eager_rounding else {}
            parts = tuple(torch.compile(f, options=options) for f in parts)
        (
            self._prologue,
            self._project,
            self._finish,
            self._between,
            self._draw,
            self._scaled_logits,
            self._head,
        ) = parts
        residual = model.residual_dtype or next(model.parameters()).dtype
        self.fused = residual == torch.float32  # `_between` (module docstring)
        self._steps: dict[tuple[int, bool], DecodeStep] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if graphs else None
        self.captures = 0

    def get(self, rows: int, *, draws: bool) -> DecodeStep:
        step = self._steps.get((rows, draws))
        if step is None:
            with torch.inference_mode(False):  # kept between calls, as the cache's views are
                step = DecodeStep(
                    rows, draws, self.model.config.vocab_size, self.cache, self.group, self.device
                )
            self._steps[rows, draws] = step
        return step

    def drop(self) -> None:
        """Forget every step and its graph. The next captures take a new private memory pool:
        the caching allocator lets a capture share a pool only while a graph that uses it is
        alive (it asserts `use_count > 0` in `beginAllocateToPool` otherwise), and the pool of
        graphs just destroyed lingers while its cached blocks are not yet freed."""
        self._steps.clear()
        if self.graphs:
            self._graph_pool = torch.cuda.graph_pool_handle()

    def run(self, step: DecodeStep, span: int) -> None:
        """One step: reads ``step.token``/``step.position``, writes the cache at each row's
        position and leaves the step's outputs; ``span``: the positions written so far (the
        keys an eager step reads)."""
        if not self.graphs:
            self._decode(step, span)
            return
        if step.graph is None:
            self._capture(step)
        assert step.graph is not None
        step.graph.replay()

    def _capture(self, step: DecodeStep) -> None:
        saved = (step.token.clone(), step.position.clone(), step.noise.clone())
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        length = self.cache.length
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside capture (compilation, kernel selection, workspaces)
                self._decode(step, length)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # Thread-local: a trainer working in another thread (not colocated) must not trip it.
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            self._decode(step, length)
        step.graph = graph
        self.captures += 1
        step.token.copy_(saved[0])
        step.position.copy_(saved[1])
        step.noise.copy_(saved[2])
        # The warm-ups wrote keys/values at the current positions: the replay rewrites them.

    def _decode(self, step: DecodeStep, span: int) -> None:
        m = self.model
        x, cos, sin, write, used = self._prologue(
            m, step.token, step.position, step.kv_base, self.cache.kv_heads
        )
        attention = _Decode(self, step, write, used, span)
        layers = m.model.layers
        q, k, v = self._project(layers[0], x, cos, sin, attention.writes(0))
        for index, layer in enumerate(layers[:-1]):
            out = attention(index, q, k, v)
            writes = attention.writes(index + 1)
            if self.fused:
                x, q, k, v = self._between(layer, layers[index + 1], x, out, cos, sin, writes)
            else:
                x = self._finish(layer, x, out)
                q, k, v = self._project(layers[index + 1], x, cos, sin, writes)
        x = self._finish(layers[-1], x, attention(len(layers) - 1, q, k, v))
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


class _Decode:
    """A decode step's `LayerAttention` (the module docstring's); `layer_project` writes the
    new keys and values at ``write`` (`_prologue`)."""

    def __init__(self, steps: DecodeSteps, step: DecodeStep, write: Tensor, used: Tensor, span: int) -> None:
        self.steps, self.step, self.write, self.used = steps, step, write, used
        self.cache, self.span = steps.cache, span
        self.mask = None
        self.split = steps.flash and steps.split_keys
        if self.split:  # each row's key count (`used` is per (row, KV head))
            self.seqlens = used.view(step.rows, -1)[:, 0].contiguous()
        if not steps.flash:  # `attend`'s: each row's first `used` keys of the `span` it reads
            mask = torch.arange(span, device=used.device) < used.view(step.rows, -1)[:, :1]
            self.mask = mask[:, None, None, :]

    def writes(self, layer: int) -> tuple[Tensor, Tensor]:
        return self.cache.flat[layer], self.write

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        step, cache = self.step, self.cache
        rows, d = step.rows, cache.head_dim
        keys, values = cache.keys[layer][:rows], cache.values[layer][:rows]
        if self.split:  # keys [rows, KV heads, length, D] as blocks [rows, length, KV heads, D]
            out, _ = paged_decode.attend(
                q.view(rows, 1, -1, d),
                keys.transpose(1, 2),
                values.transpose(1, 2),
                step.table,
                self.seqlens,
                d**-0.5,
                False,
            )
            return out.view(rows, -1)
        if self.mask is None:
            q, keys, values = q.view(-1, 1, d), keys.view(-1, 1, d), values.view(-1, 1, d)
            out = _flash_varlen(
                q, keys, values, step.cu_q, step.cu_k, self.steps.group, cache.length, self.used
            )
            return out.view(rows, -1)
        keys, values = keys[:, :, : self.span], values[:, :, : self.span]
        return attend(q.unsqueeze(2), keys, values, self.mask, False).view(rows, -1)


def _flash_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, used: Tensor
) -> Tensor:
    """Flash attention over variable-length sequences: sequence i's queries q[cu_q[i]:cu_q[i+1]]
    over its keys and values from cu_k[i], the first used[i] of them; not causal."""
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, False, False, seqused_k=used
    )[0]


# The parts of a decode step around attention, as plain functions (not methods) so that one
# torch.compile'd version serves every layer and call (dynamo lifts parameters to inputs).


def _prologue(
    model: Decoder, token: Tensor, position: Tensor, kv_base: Tensor, kv_heads: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A step's inputs to every layer: embeddings, rotary cos/sin [rows, 1, D], where each
    (row, KV head)'s new key and value go in a layer's `KVCache.flat` (``kv_base`` + position,
    keys then values), and how many keys each (row, KV head) attends over (int32)."""
    cos, sin = model.rotary(position)
    per_head = position.unsqueeze(1).expand(-1, kv_heads).reshape(-1)
    write = kv_base + torch.cat((per_head, per_head))
    return model.embed(token, position), cos, sin, write, (per_head + 1).to(torch.int32)


# The layer's parts in code objects of their own, so that torch.compile's versions of them for
# the decode step (other options, other shapes) never count against the recompile limit of the
# trainer's `compiled_layer_parts`.


def _project(
    layer: DecoderLayer, x: Tensor, cos: Tensor, sin: Tensor, writes: tuple[Tensor, Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    return layer_project(layer, x, cos, sin, writes)


def _finish(layer: DecoderLayer, x: Tensor, out: Tensor) -> Tensor:
    return layer_finish(layer, x, out)


def _between(
    layer: DecoderLayer,
    following: DecoderLayer,
    x: Tensor,
    out: Tensor,
    cos: Tensor,
    sin: Tensor,
    writes: tuple[Tensor, Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``layer``'s finish over its attention's ``out``, then ``following``'s projection: the
    residual stream after ``layer`` and the next layer's queries, keys and values."""
    x = layer_finish(layer, x, out)
    return (x, *layer_project(following, x, cos, sin, writes))


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
