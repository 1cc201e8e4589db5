"""A GPU sampler over a `Decoder`: batched prefill, one preallocated KV cache, decode steps
replayed from CUDA graphs, per-token logprobs. Same contract as `Sampler.generate`.

Layout. The KV cache is one flat buffer from a `KVPool` (after the packed weights, below),
viewed per layer as keys and values [rows, length, kv_heads, head_dim]. Every row keeps its own
tokens at positions 0..n-1 (no left padding), so a decode step writes each row at its own
position and attention reads the first ``position + 1`` keys of each row: on CUDA through
flash attention's variable-length kernel with ``seqused_k``, so one captured graph serves every
step of a batch-size bucket (no KV-length buckets, no masks). Grouped-query attention is
computed with the query heads of one KV head laid out as that KV head's query "sequence"
(non-causal), so each row's keys and values are read once per step rather than once per query
head.

Sampling. The graph also samples: with exponential noise E, ``argmax(softmax(logits / T) /
E)``, computed as ``argmax(logits / T - log E)``, is a draw from softmax(logits / T), and with
E = 1 it is the greedy choice. On CUDA the noise is made inside one Triton pass over the logits
(`race.race_draw`) from a seed drawn from the caller's generator before each replay; elsewhere
a noise tensor is drawn from it. Logprobs are those of the sampled token under log_softmax(logits / T),
temperature 1 for greedy, before any top-p truncation. With ``top_p < 1`` a second graph
stops at the logits and the caller draws from them eagerly.

Kernels. Each layer's q/k/v and gate/up projections run as one GEMM each over packed copies of
their weights, which live in the KV cache's pool (released and restored with it) and are
copied from the model at every `wake` and `refresh` (and when the pool is laid out anew): whoever
changes the model's weights calls one of them before the next call (the engine does, at each
handoff). For flash, the packed copies of q_proj's
rows and o_proj's columns are in flash's query order ([g, kv_heads] rather than heads), so
queries go into attention, and its output into o_proj, without a transposing copy. The wider
GEMMs may round differently from the trainer's separate projections, as any other engine kernel
may. With ``compiled`` the code between attention calls runs as torch.compile'd kernels (norms,
rotations with the cache write of the new keys and values, residual adds, SwiGLU fused),
captured into the graphs like any other kernel, and so does the prefill's
(`compiled_layer_parts`, which the trainer's `train.compile` shares).

Colocation. Graphs read the model's parameter tensors in place: the trainer must update them
in place (optimizers do), never rebind them. `release` hands the KV cache's memory back to the
driver; `wake` maps it again at the same addresses, so the graphs stay valid. Where the pool
cannot keep addresses (`PlainPool`), `wake` drops the graphs and the next call captures them
again. On CPU (tests) the same code runs eagerly with SDPA and a length mask.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from backends.torch import race
from backends.torch.fingerprint import Probe, parameter_probe, sample_rows
from backends.torch.kv_pool import KVPool, make_pool
from backends.torch.model import Decoder, DecoderLayer, compiled_layer_parts, layer_finish, layer_project
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


class _Packed(NamedTuple):
    """One layer's projections that read the same input, concatenated (one GEMM each), and
    o_proj's weight; query heads in the order `_attend` takes them."""

    qkv_weight: Tensor
    qkv_bias: Tensor | None
    o_weight: Tensor
    gate_up_weight: Tensor


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
        # Where each row's keys, then its values, start in a layer's `CudaSampler._kv`.
        row_base = torch.arange(rows, device=device) * length
        self.kv_base = torch.cat((row_base, row_base + pool_rows * length))
        # Flash's variable-length offsets: g query "positions" and `length` keys per row.
        self.cu_q = torch.arange(0, (rows + 1) * group, group, dtype=torch.int32, device=device)
        self.cu_k = torch.arange(0, (rows + 1) * length, length, dtype=torch.int32, device=device)


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
        parts = (_prologue, _before_attention, _after_attention, _draw, _scaled_logits, _head)
        if self.compiled:
            # The first batch-size bucket gets kernels for its shapes, a second one kernels for
            # any number of rows (dynamo's automatic dynamic shapes), so buckets never exhaust
            # its recompile limit; past that limit (other dtypes, models) a part runs uncompiled.
            options = {"emulate_precision_casts": True} if eager_rounding else {}
            parts = tuple(torch.compile(f, options=options) for f in parts)
        (
            self._prologue,
            self._before_attention,
            self._after_attention,
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
        self._packed: list[_Packed] = []
        self._steps: dict[tuple[int, bool], _Step] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self._down = False
        self._fresh = False  # the packed copies hold the model's current weights
        self.layout = 0  # counts the pool's layouts (`probes` changes with it)
        self.captures = 0

    # ---- memory and handoff -------------------------------------------------------------

    def cache_bytes(self) -> int:
        """Device bytes the pool holds now: the KV cache and the packed weights (0 while stood
        down or before the first call)."""
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
        self._pack()

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the model's weights into the packed copies now (after they changed without a
        stand-down: a refit, a loaded checkpoint)."""
        if self.rows and not self._down:
            self._pack()

    def _ensure(self, rows: int, length: int) -> None:
        if self._down:
            self.wake()
        if rows <= self.rows and length <= self.length:
            return
        rows, length = max(rows, self.rows), max(length, self.length)
        self._drop_graphs()
        self._keys, self._values, self._kv, self._packed = [], [], [], []
        per = rows * length * self.kv_heads * self.head_dim
        layers = self.model.config.num_hidden_layers
        elements = self._packed_elements() + 2 * layers * per
        # Ordinary tensors, though `generate` runs in inference mode: the pool's views outlive
        # the call, and `wake` and `refresh` update them in place outside it.
        with torch.inference_mode(False):
            buffer = self.pool.allocate(elements * torch.finfo(self.dtype).bits // 8)
            self.rows, self.length = rows, length
            self._view(buffer)
        self._clear_for_masks()
        self._fresh = False

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

    def _packed_shapes(self) -> dict[str, tuple[int, ...]]:
        """`_Packed`'s tensors and their shapes (no bias without attention_bias)."""
        c = self.model.config
        q = c.num_attention_heads * c.head_dim
        qkv = q + 2 * c.num_key_value_heads * c.head_dim
        shapes = {"qkv_weight": (qkv, c.hidden_size), "qkv_bias": (qkv,)}
        if not c.attention_bias:
            del shapes["qkv_bias"]
        return shapes | {
            "o_weight": (c.hidden_size, q),
            "gate_up_weight": (2 * c.intermediate_size, c.hidden_size),
        }

    def _packed_elements(self) -> int:
        per_layer = sum(_aligned(math.prod(shape)) for shape in self._packed_shapes().values())
        return self.model.config.num_hidden_layers * per_layer

    def _head_order(self) -> Tensor:
        """Query heads in `_attend`'s order: for flash [g, kv_heads] (head j * g + i at
        i * kv_heads + j), else the model's."""
        c = self.model.config
        heads = torch.arange(c.num_attention_heads, device=self.device)
        return heads.view(self.kv_heads, self.group).T.reshape(-1) if self.flash else heads

    def _view(self, buffer: Tensor) -> None:
        """Views of the pool's buffer: each layer's packed weights, then keys and values."""
        flat = buffer.view(self.dtype)
        layers = self.model.config.num_hidden_layers
        offset = 0
        self._packed = []
        for _ in range(layers):
            views: dict[str, Tensor | None] = {"qkv_bias": None}
            for name, shape in self._packed_shapes().items():
                views[name] = flat[offset : offset + math.prod(shape)].view(shape)
                offset += _aligned(math.prod(shape))
            self._packed.append(_Packed(**views))
        shape = (self.rows, self.length, self.kv_heads, self.head_dim)
        per = math.prod(shape)
        kv = flat[offset:]
        # A layer's keys and values are adjacent: one index_copy_ writes both (`_before_attention`).
        self._kv = [kv[2 * i * per : (2 * i + 2) * per].view(-1, *shape[2:]) for i in range(layers)]
        self._keys = [both[: self.rows * self.length].view(shape) for both in self._kv]
        self._values = [both[self.rows * self.length :].view(shape) for both in self._kv]
        self.layout += 1

    def _pack(self) -> None:
        """Copy the model's current weights into the packed ones: the trainer changes them
        while the engine is down, and a woken pool's contents are undefined."""
        order = self._head_order()
        d = self.head_dim
        for layer, packed in zip(self.model.model.layers, self._packed, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            q = attn.q_proj.weight.view(-1, d, attn.q_proj.in_features)[order].flatten(0, 1)
            torch.cat((q, attn.k_proj.weight, attn.v_proj.weight), out=packed.qkv_weight)
            if packed.qkv_bias is not None:
                q_bias = attn.q_proj.bias.view(-1, d)[order].flatten()
                torch.cat((q_bias, attn.k_proj.bias, attn.v_proj.bias), out=packed.qkv_bias)
            o = attn.o_proj.weight
            packed.o_weight.copy_(o.view(o.shape[0], -1, d)[:, order].flatten(1))
            torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight), out=packed.gate_up_weight)
        self._fresh = True

    def probes(self) -> list[Probe]:
        """Where the weights this sampler serves live (`fingerprint`): each layer's packed
        copies for its projections (in `_pack`'s layout), the model's own tensors for the rest."""
        if not self._packed:
            return [parameter_probe(name, p) for name, p in self.model.named_parameters()]
        c = self.model.config
        d, hidden = self.head_dim, c.hidden_size
        q_size, kv_size = c.num_attention_heads * d, self.kv_heads * d
        place = torch.argsort(self._head_order())  # packed position of each query head

        def q_index(index: Tensor) -> Tensor:  # a q_proj row (o_proj column) in the packed order
            return place[index // d] * d + index % d

        probes = []
        for name, param in self.model.named_parameters():
            parts = name.split(".")
            if parts[:2] != ["model", "layers"] or ".".join(parts[4:]) not in _PACKED_PARTS:
                probes.append(parameter_probe(name, param))
                continue
            packed, part = self._packed[int(parts[2])], ".".join(parts[4:])
            rows, cols = sample_rows(param.shape, self.device)
            if part == "o_proj.weight":
                base, index = packed.o_weight, rows * q_size + q_index(cols)
            elif part.endswith(".bias"):
                first = {"q_proj.bias": 0, "k_proj.bias": q_size, "v_proj.bias": q_size + kv_size}[part]
                assert packed.qkv_bias is not None
                base, index = packed.qkv_bias, first + (q_index(rows) if first == 0 else rows)
            else:
                first, base = {
                    "q_proj.weight": (0, packed.qkv_weight),
                    "k_proj.weight": (q_size, packed.qkv_weight),
                    "v_proj.weight": (q_size + kv_size, packed.qkv_weight),
                    "gate_proj.weight": (0, packed.gate_up_weight),
                    "up_proj.weight": (c.intermediate_size, packed.gate_up_weight),
                }[part]
                row = first + (q_index(rows) if part == "q_proj.weight" else rows)
                index = row * hidden + cols
            probes.append(Probe(name, base.view(-1), index))
        return probes

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
        if not self._fresh:
            self._pack()
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
        u, t = ids.shape
        positions = torch.arange(t, device=ids.device)
        cos, sin = m.rotary(positions)  # [T, 1, D]
        x = m.embed(ids, positions)
        compiled = self.compiled and not self.eager_rounding
        project, finish = compiled_layer_parts() if compiled else (layer_project, layer_finish)
        for i, layer in enumerate(m.model.layers):
            q, k, v = project(layer, x, cos, sin)  # [U, T, heads or kv_heads, D]
            self._keys[i][dest, :t] = k[src]
            self._values[i][dest, :t] = v[src]
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=True,
                enable_gqa=self.group > 1,
            )
            x = finish(layer, x, out.transpose(1, 2).reshape(u, t, -1))
        return m.model.norm(x)

    # ---- decode -------------------------------------------------------------------------

    def _step(self, rows: int, *, draws: bool) -> _Step:
        step = self._steps.get((rows, draws))
        if step is None:
            with torch.inference_mode(False):  # kept between calls, as the pool's views are
                step = _Step(rows, draws, self.vocab, self.length, self.group, self.rows, self.device)
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
        x, cos, sin, write, used = self._prologue(m, step.token, step.position, step.kv_base)
        rows = step.rows
        for i, (layer, packed) in enumerate(zip(m.model.layers, self._packed, strict=True)):
            q = self._before_attention(layer, packed, x, cos, sin, self._kv[i], write)
            out = self._attend(q, self._keys[i][:rows], self._values[i][:rows], used, step)
            x = self._after_attention(layer, packed, x, out)
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

    def _attend(self, q: Tensor, keys: Tensor, values: Tensor, used: Tensor, step: _Step) -> Tensor:
        """Attention of one new query per row over its first ``used`` keys: queries [rows,
        heads, D] in `_head_order`, the output in the same layout. Grouped-query attention as
        in the module docstring: for flash, the g query heads of a KV head are g query
        positions of its variable-length sequence; for SDPA, a batch of g heads."""
        kvh, d, g, rows = self.kv_heads, self.head_dim, self.group, step.rows
        if self.flash:
            return torch.ops.aten._flash_attention_forward(
                q.view(rows * g, kvh, d),
                keys.view(rows * self.length, kvh, d),
                values.view(rows * self.length, kvh, d),
                step.cu_q,
                step.cu_k,
                g,
                self.length,
                0.0,
                False,
                False,
                seqused_k=used,
            )[0]
        mask = torch.arange(self.length, device=q.device) < used.unsqueeze(-1)
        return F.scaled_dot_product_attention(
            q.view(rows, kvh, g, d),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
        )


# A layer's parameters (after its ``model.layers.N.<module>.``) that `_pack` copies.
_PACKED_PARTS = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias"}
_PACKED_PARTS |= {"v_proj.bias", "o_proj.weight", "gate_proj.weight", "up_proj.weight"}

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


def _aligned(elements: int) -> int:
    """Elements rounded up to 128 (256 bytes in bf16: aligned for any GEMM kernel)."""
    return -(-elements // 128) * 128


# The parts of a decode step between attention calls. They are plain functions of a layer (not
# methods) so that one torch.compile'd version serves every layer: dynamo lifts the layer's
# parameters to inputs instead of recompiling per layer.


def _prologue(
    model: Decoder, token: Tensor, position: Tensor, kv_base: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A step's inputs to every layer: embeddings, rotary cos/sin [rows, 1, D], where each row's
    new key and value go in a layer's flat keys-then-values (``kv_base`` + position, keys
    then values), and how many keys each row attends over (int32)."""
    cos, sin = model.rotary(position)
    write = kv_base + torch.cat((position, position))
    return model.embed(token, position), cos, sin, write, (position + 1).to(torch.int32)


def _before_attention(
    layer: DecoderLayer, packed: _Packed, x: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, write: Tensor
) -> Tensor:
    """Input norm, projections, rotation: writes the rows' new keys, then values, into the
    layer's cache ``kv`` [2 * rows * length, kv_heads, D] at ``write`` (`_prologue`; in the
    compiled step, in the same kernel as their rotation), and returns the queries [rows,
    heads, D] (in the packed weights' head order)."""
    attn = layer.self_attn
    qkv = F.linear(layer.input_layernorm(x), packed.qkv_weight, packed.qkv_bias)
    kv_size = attn.kv_heads * attn.head_dim
    q, k, v = attn.rotated(*qkv.split((attn.heads * attn.head_dim, kv_size, kv_size), dim=-1), cos, sin)
    kv.index_copy_(0, write, torch.cat((k, v)))
    return q


def _after_attention(layer: DecoderLayer, packed: _Packed, x: Tensor, out: Tensor) -> Tensor:
    """Output projection, residual, MLP, residual, from `_attend`'s output (query heads in
    the packed weights' order, as o_weight's columns)."""
    x = x + F.linear(out.reshape(x.shape[0], -1), packed.o_weight)
    gate, up = F.linear(layer.post_attention_layernorm(x), packed.gate_up_weight).chunk(2, dim=-1)
    return x + layer.mlp.combine(gate, up)


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
