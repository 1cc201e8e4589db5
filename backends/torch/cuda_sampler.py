"""A GPU sampler over a `Decoder`: batched prefill, one preallocated KV cache, decode steps
replayed from CUDA graphs, per-token logprobs. Same contract as `Sampler.generate`.

Layout. The KV cache is one flat buffer from a `KVPool`, viewed per layer as keys and values
[rows, length, kv_heads, head_dim]. Every row keeps its own tokens at positions 0..n-1 (no
left padding), so a decode step writes each row at its own position and attention reads the
first ``position + 1`` keys of each row: on CUDA through flash attention's variable-length
kernel with ``seqused_k``, so one captured graph serves every step of a batch-size bucket
(no KV-length buckets, no masks). Grouped-query attention is computed with the query heads of
one KV head laid out as that KV head's query "sequence" (non-causal), so each row's keys and
values are read once per step rather than once per query head.

Sampling. The graph also samples: with exponential noise E (drawn from the caller's generator
before each replay, outside the graph), ``argmax(softmax(logits / T) / E)`` is a draw from
softmax(logits / T), and with E = 1 it is the greedy choice. Logprobs are those of the sampled
token under log_softmax(logits / T), temperature 1 for greedy, before any top-p truncation.
With ``top_p < 1`` the graph stops at the logits and sampling runs eagerly.

Colocation. Graphs read the model's parameter tensors in place: the trainer must update them
in place (optimizers do), never rebind them. `release` hands the KV cache's memory back to the
driver; `wake` maps it again at the same addresses, so the graphs stay valid. Where the pool
cannot keep addresses (`PlainPool`), `wake` drops the graphs and the next call captures them
again. On CPU (tests) the same code runs eagerly with SDPA and a length mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from backends.torch.kv_pool import KVPool, make_pool
from backends.torch.model import Decoder, DecoderLayer
from backends.torch.sampling import check_arguments, completions, draw
from pipeline.messages import Completion

_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)
# Tokens of the prefill forward at once (bounds prefill activation memory).
_PREFILL_TOKENS = 32768


def _bucket(n: int) -> int:
    for b in _BUCKETS:
        if b >= n:
            return b
    return n


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
    """Static buffers of one decode step over ``rows`` rows, and its captured graph."""

    def __init__(self, rows: int, vocab: int, length: int, group: int, device: torch.device) -> None:
        self.rows = rows
        self.token = torch.zeros(rows, dtype=torch.long, device=device)
        self.position = torch.zeros(rows, dtype=torch.long, device=device)
        self.noise = torch.ones(rows, vocab, dtype=torch.float32, device=device)
        self.inv_temperature = torch.ones((), dtype=torch.float32, device=device)
        self.logits = torch.empty(rows, vocab, dtype=torch.float32, device=device)
        self.logprob = torch.empty(rows, dtype=torch.float32, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.sampled = False
        self.row_base = torch.arange(rows, device=device) * length
        # Flash's variable-length offsets: g query "positions" and `length` keys per row.
        self.cu_q = torch.arange(0, (rows + 1) * group, group, dtype=torch.int32, device=device)
        self.cu_k = torch.arange(0, (rows + 1) * length, length, dtype=torch.int32, device=device)


class CudaSampler:
    """Generates completions with a KV cache and (on CUDA) CUDA-graph decode steps.

    ``graphs``: capture decode steps (CUDA only). ``flash``: variable-length flash attention
    for decode (CUDA only; otherwise SDPA with a key mask). The cache grows to the largest
    bucketed batch and length seen; growing it drops and re-captures the graphs.
    """

    def __init__(
        self,
        model: Decoder,
        *,
        graphs: bool = True,
        flash: bool = True,
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
        c = model.config
        self.kv_heads, self.head_dim = c.num_key_value_heads, c.head_dim
        self.group = c.num_attention_heads // c.num_key_value_heads
        self.vocab = c.vocab_size
        self.pool = pool if pool is not None else make_pool(self.device)
        self.rows = 0
        self.length = 0
        self._keys: list[Tensor] = []
        self._values: list[Tensor] = []
        self._steps: dict[int, _Step] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self._down = False
        self.captures = 0

    # ---- memory and handoff -------------------------------------------------------------

    def cache_bytes(self) -> int:
        """Device bytes the KV cache holds now (0 while stood down or before the first call)."""
        return self.pool.resident_bytes

    def release(self) -> None:
        """Stand down: free the KV cache's memory; graphs are kept for `wake`."""
        if self.rows and not self._down:
            self.pool.release()
            self._down = True

    def wake(self) -> None:
        """Map the KV cache again (same addresses where the pool allows; otherwise the graphs
        are dropped and captured again on the next call)."""
        if not self._down:
            return
        buffer = self.pool.restore()
        self._down = False
        if not self.pool.stable:
            self._view(buffer)
            self._steps.clear()

    def _ensure(self, rows: int, length: int) -> None:
        if self._down:
            self.wake()
        if rows <= self.rows and length <= self.length:
            return
        rows, length = max(rows, self.rows), max(length, self.length)
        self._steps.clear()
        self._keys, self._values = [], []
        per = rows * length * self.kv_heads * self.head_dim
        layers = self.model.config.num_hidden_layers
        buffer = self.pool.allocate(2 * layers * per * torch.finfo(self.dtype).bits // 8)
        self.rows, self.length = rows, length
        self._view(buffer)

    def _view(self, buffer: Tensor) -> None:
        shape = (self.rows, self.length, self.kv_heads, self.head_dim)
        per = self.rows * self.length * self.kv_heads * self.head_dim
        flat = buffer.view(self.dtype)
        layers = self.model.config.num_hidden_layers
        self._keys = [flat[(2 * i) * per : (2 * i + 1) * per].view(shape) for i in range(layers)]
        self._values = [flat[(2 * i + 1) * per : (2 * i + 2) * per].view(shape) for i in range(layers)]

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
        step = self._step(rows)
        dev = self.device
        greedy = temperature == 0
        eager_sampling = top_p < 1 and not greedy

        hidden = self._prefill(prompts, rows)
        step.position[:batch] = torch.tensor(lengths, device=dev)
        step.position[batch:] = 0
        step.inv_temperature.fill_(1.0 if greedy else 1.0 / temperature)

        stop = torch.tensor(list(stop_token_ids), dtype=torch.long, device=dev)
        tokens = torch.empty(rows, max_new_tokens, dtype=torch.long, device=dev)
        logprobs = torch.empty(rows, max_new_tokens, dtype=torch.float32, device=dev)
        generated = torch.zeros(rows, dtype=torch.long, device=dev)
        done = torch.zeros(rows, dtype=torch.bool, device=dev)
        done[batch:] = True

        # The first token comes from the prefill's hidden states, eagerly.
        token, logprob = draw(self._logits(hidden), temperature, top_p, generator)
        count = 0
        while True:
            tokens[:, count] = token
            logprobs[:, count] = logprob
            generated += ~done
            if stop.numel():
                done |= torch.isin(token, stop)
            count += 1
            if count == max_new_tokens:
                break
            if stop.numel() and count % self.check_every == 0 and bool(done.all()):
                break
            if token is not step.token:
                step.token.copy_(token)
            if not greedy and not eager_sampling:
                step.noise.exponential_(generator=generator)
            elif greedy and step.sampled:
                step.noise.fill_(1.0)
            step.sampled = not greedy
            self._replay(step, sample=not eager_sampling)
            step.position += 1
            if eager_sampling:
                # step.logits already holds logits / temperature.
                token, logprob = draw(step.logits, 1.0, top_p, generator)
            else:
                # Read (by the copies above) before the next replay overwrites them.
                token, logprob = step.token, step.logprob

        return completions(
            generated[:batch], tokens[:batch, :count], logprobs[:batch, :count], stop_token_ids
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
        for i, layer in enumerate(m.model.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v = (y.transpose(1, 2) for y in attn.project(h, cos, sin))
            self._keys[i][dest, :t] = k.transpose(1, 2)[src]
            self._values[i][dest, :t] = v.transpose(1, 2)[src]
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=attn.heads != attn.kv_heads
            )
            x = x + attn.o_proj(out.transpose(1, 2).reshape(u, t, attn.heads * attn.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return m.model.norm(x)

    # ---- decode -------------------------------------------------------------------------

    def _step(self, rows: int) -> _Step:
        step = self._steps.get(rows)
        if step is None:
            step = self._steps[rows] = _Step(rows, self.vocab, self.length, self.group, self.device)
        return step

    def _replay(self, step: _Step, *, sample: bool) -> None:
        if not self.graphs:
            self._decode(step, sample)
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
            for _ in range(2):  # warm-up outside capture (kernel selection, workspaces)
                self._decode(step, True)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # Thread-local: a trainer working in another thread (not colocated) must not trip it.
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            self._decode(step, True)
        step.graph = graph
        self.captures += 1
        step.token.copy_(saved[0])
        step.position.copy_(saved[1])
        step.noise.copy_(saved[2])
        # The warm-ups wrote keys/values at the current positions: the replay rewrites them.

    def _decode(self, step: _Step, sample: bool) -> None:
        """One decode step over all of ``step.rows``: reads token/position, writes the cache at
        each row's position, leaves logits / T in ``step.logits`` and (when ``sample``) the
        sampled token and its logprob in ``step.token``/``step.logprob``."""
        m = self.model
        position = step.position
        cos, sin = m.rotary(position)  # [rows, 1, D]
        write = step.row_base + position
        used = (position + 1).to(torch.int32)
        x = m.embed(step.token, position)
        for i, layer in enumerate(m.model.layers):
            x = self._decode_layer(layer, x, cos, sin, i, write, used, step)
        hidden = m.model.norm(x)
        scaled = torch.mul(self._logits(hidden), step.inv_temperature, out=step.logits)
        if sample:
            probs = torch.softmax(scaled, dim=-1)
            token = (probs / step.noise).argmax(dim=-1)
            picked = scaled.gather(-1, token.unsqueeze(-1)).squeeze(-1)
            step.logprob.copy_(picked - torch.logsumexp(scaled, dim=-1))
            step.token.copy_(token)

    def _decode_layer(
        self,
        layer: DecoderLayer,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        i: int,
        write: Tensor,
        used: Tensor,
        step: _Step,
    ) -> Tensor:
        attn = layer.self_attn
        kvh, d, rows = self.kv_heads, self.head_dim, step.rows
        h = layer.input_layernorm(x)
        q, k, v = attn.project(h, cos, sin)
        keys = self._keys[i][:rows]
        values = self._values[i][:rows]
        keys.view(rows * self.length, kvh, d).index_copy_(0, write, k)
        values.view(rows * self.length, kvh, d).index_copy_(0, write, v)
        out = self._attend(q, keys, values, used, step)
        x = x + attn.o_proj(out)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _attend(self, q: Tensor, keys: Tensor, values: Tensor, used: Tensor, step: _Step) -> Tensor:
        """Attention of one new query per row over its first ``used`` keys; [rows, heads * d]."""
        kvh, d, g, rows = self.kv_heads, self.head_dim, self.group, step.rows
        if self.flash:
            # Query head h belongs to KV head h // g (HF repeat_kv order): present the g query
            # heads of a KV head as g query positions of that head.
            q_var = q.view(rows, kvh, g, d).transpose(1, 2).reshape(rows * g, kvh, d)
            out = torch.ops.aten._flash_attention_forward(
                q_var,
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
            return out.view(rows, g, kvh, d).transpose(1, 2).reshape(rows, kvh * g * d)
        mask = torch.arange(self.length, device=q.device) < used.unsqueeze(-1)
        out = F.scaled_dot_product_attention(
            q.view(rows, kvh, g, d),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
        )
        return out.reshape(rows, kvh * g * d)
