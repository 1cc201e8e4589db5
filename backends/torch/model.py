"""Llama/Mistral/Qwen2/Qwen3-family decoder whose parameter names equal Hugging Face's.

Layout (per ``ModelConfig``): token embedding, ``num_hidden_layers`` pre-norm blocks of
RMSNorm -> grouped-query attention with rotary embeddings (queries and keys RMS-normalised per
head first, with ``qk_norm``) -> residual -> RMSNorm ->
SwiGLU MLP -> residual, a final RMSNorm and an (optionally tied) output projection.
"""

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backends.torch.config import ModelConfig
from backends.torch.logprobs import picked_logprobs

_INIT_STD = 0.02


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Rotary inverse frequencies [head_dim // 2] in float32, after ``rope_scaling``."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
    context = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, blended, scaled)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of x [..., D] in the rotate-half convention of Hugging Face checkpoints
    (pairs (i, i + D/2)), given cos = (c, c) and sin = (-s, s) over D (`Decoder.rotary`):
    x * cos + (x2, x1) * sin, four ops with the roundings of (x1 c - x2 s, x2 c + x1 s), since
    a + (-b) is a - b exactly."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin


class KVCache:
    """Preallocated key/value buffers, one pair per layer, each [batch, kv_heads, length, head_dim].

    A forward call with ``cache_start=s`` and T new tokens writes positions [s, s + T) of
    every row and attends over positions [0, s + T); positions beyond are never read.
    """

    def __init__(self, keys: list[Tensor], values: list[Tensor]) -> None:
        self.keys = keys
        self.values = values

    @classmethod
    def allocate(
        cls, config: ModelConfig, batch: int, length: int, *, dtype: torch.dtype, device: torch.device
    ) -> "KVCache":
        shape = (batch, config.num_key_value_heads, length, config.head_dim)
        layers = range(config.num_hidden_layers)
        return cls(
            [torch.empty(shape, dtype=dtype, device=device) for _ in layers],
            [torch.empty(shape, dtype=dtype, device=device) for _ in layers],
        )

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]

    def rows(self, n: int) -> "KVCache":
        """A cache over the first ``n`` rows, sharing storage with this one."""
        return KVCache([k[:n] for k in self.keys], [v[:n] for v in self.values])


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, cast to the weight's dtype and scaled (HF
    semantics when the residual stream has the weight's dtype)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(self.weight.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated queries [..., T, heads, D] and keys, values [..., T, kv_heads, D] of tokens
        x [..., T, hidden]; `cos`/`sin` [..., T, 1, D] (`Decoder.rotary`)."""
        return self.rotated(self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin)

    def rotated(
        self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """`project`'s result from the projections q [..., heads * D], k and v [..., kv_heads * D]
        (the one place of every attention path where queries and keys are split into heads)."""
        lead = q.shape[:-1]
        q = q.view(*lead, self.heads, self.head_dim)
        k = k.view(*lead, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return rotate(q, cos, sin), rotate(k, cos, sin), v.view(*lead, self.kv_heads, self.head_dim)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        is_causal: bool,
        cache: tuple[Tensor, Tensor] | None,
        start: int,
    ) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (y.transpose(1, 2) for y in self.project(x, cos, sin))
        if cache is not None:
            k_cache, v_cache = cache
            k_cache[:, :, start : start + t] = k
            v_cache[:, :, start : start + t] = v
            k, v = k_cache[:, :, : start + t], v_cache[:, :, : start + t]
        out = attend(q, k, v, mask, is_causal)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
    """Attention of [B, H, T, D] queries over [B, KV, S, D] keys/values (KV divides H), with a
    bool `mask` [T, S] or [B, 1, T, S] (True: attend; the same for every head) or `is_causal`."""
    if not q.is_cuda and q.shape[2] * k.shape[2] <= _MATH_MAX_SCORES:
        return _math_attention(q, k, v, mask, is_causal)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=q.shape[1] != k.shape[1]
    )


# On CPU, for short sequences, softmax(QK^T)V written out beats torch's CPU flash kernel: its
# backward dominates a training step (reverse-digits: 38 vs 43 ms a step) and each decode step
# pays its fixed cost (13 vs 15 ms to sample a batch). Above this many query x key positions
# the kernel's memory saving wins.
_MATH_MAX_SCORES = 128 * 128


def _math_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
    """`attend` written out: each key/value head serves its group of query heads through a
    reshape (no repeated copies of keys and values)."""
    b, h, t, d = q.shape
    kv, s = k.shape[1], k.shape[2]
    grouped = q.reshape(b, kv, (h // kv) * t, d)
    scores = (grouped @ k.transpose(-1, -2)).view(b, kv, h // kv, t, s) * d**-0.5
    if is_causal:
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    if mask is not None:
        scores = scores.masked_fill(~(mask.unsqueeze(2) if mask.dim() == 4 else mask), float("-inf"))
    weights = _Softmax.apply(scores.float()).to(v.dtype)
    return (weights.view(b, kv, (h // kv) * t, s) @ v).view(b, h, t, d)


class _Softmax(torch.autograd.Function):
    """Softmax over the last dimension. On CPU, torch's kernel is slow for the short rows of
    attention over a few keys (a fifth of the speed of this one at 11 keys)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        e = (x - x.amax(dim=-1, keepdim=True)).exp_()
        y = e.div_(e.sum(dim=-1, keepdim=True))
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        weighted = grad * y
        return weighted.sub_(y * weighted.sum(dim=-1, keepdim=True))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.combine(self.gate_proj(x), self.up_proj(x))

    def combine(self, gate: Tensor, up: Tensor) -> Tensor:
        """The output from the gate and up projections."""
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        is_causal: bool,
        cache: tuple[Tensor, Tensor] | None,
        start: int,
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, is_causal, cache, start)
        return x + self.mlp(self.post_attention_layernorm(x))


# A layer's position-wise parts around attention, as plain functions of the layer (not methods)
# so that one torch.compile'd version serves every layer (dynamo lifts a layer's parameters to
# inputs). The trainer's prompt-sharing pass and the CUDA sampler's prefill use them.


def layer_project(layer: DecoderLayer, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Input norm, then rotated queries [..., T, heads, D], keys and values [..., T, kv_heads, D]."""
    return layer.self_attn.project(layer.input_layernorm(x), cos, sin)


def layer_finish(layer: DecoderLayer, x: Tensor, out: Tensor) -> Tensor:
    """Output projection of attention's ``out`` [..., T, heads * D], residual, MLP, residual."""
    x = x + layer.self_attn.o_proj(out)
    return x + layer.mlp(layer.post_attention_layernorm(x))


_COMPILED_PARTS: list[Any] = []


def compiled_layer_parts() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """`layer_project` and `layer_finish` through torch.compile (inductor), for any number of
    tokens (dynamo's automatic dynamic shapes), with and without gradients."""
    if not _COMPILED_PARTS:
        # Dynamo reads the .grad of every tensor it traces, and the residual stream between
        # layers is not a leaf: torch warns of that access at each compile, needlessly.
        warnings.filterwarnings("ignore", "The .grad attribute of a Tensor that is not a leaf", UserWarning)
        _COMPILED_PARTS.extend(torch.compile(f) for f in (layer_project, layer_finish))
    return _COMPILED_PARTS[0], _COMPILED_PARTS[1]


class Backbone(nn.Module):
    """Everything but the output projection; the ``model.`` prefix of HF parameter names."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = (
            nn.Embedding(config.max_position_embeddings, config.hidden_size)
            if config.learned_position_embeddings
            else None
        )
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Decoder(nn.Module):
    """Causal language model; ``state_dict()`` keys equal the Hugging Face checkpoint's.

    With ``tie_word_embeddings`` the output projection is the embedding Parameter itself,
    so ``lm_head.weight`` and ``model.embed_tokens.weight`` are one tensor.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.apply(_init_weights)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Kept off the module's buffers so that casting the model to bf16 cannot round it.
        self._inv_freq: dict[torch.device, Tensor] = {}
        # The residual stream's dtype; None: the parameters' (as Hugging Face models run).
        # float32 under bf16 weights keeps each layer's sum unrounded, so engine and trainer,
        # whose kernels round differently, drift apart less (see backends/torch/section.py).
        self.residual_dtype: torch.dtype | None = None

    def hidden_states(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        attn_mask: Tensor | None = None,
        kv_cache: KVCache | None = None,
        cache_start: int = 0,
    ) -> Tensor:
        """Final-norm hidden states [B, T, hidden_size] in the model dtype.

        ``input_ids``/``position_ids``: [B, T] integer tensors. Attention is always causal.
        ``attn_mask``: None (every key is a real token) or bool [B, S] over all keys so far,
        S = cache_start + T, True = real token. A query whose own key is masked (a padding
        query) still attends to itself, so padding never produces NaN.
        ``kv_cache``: when given, the new keys/values are written at [cache_start,
        cache_start + T) and attention covers the cached prefix as well.
        """
        b, t = input_ids.shape
        s = cache_start + t
        if kv_cache is not None and s > kv_cache.length:
            raise ValueError(f"KV cache holds {kv_cache.length} positions, need {s}")
        if attn_mask is not None and attn_mask.shape != (b, s):
            raise ValueError(f"attn_mask must be [{b}, {s}], got {list(attn_mask.shape)}")
        mask, is_causal = attention_mask(attn_mask, t, cache_start, input_ids.device)

        x = self.embed(input_ids, position_ids)
        cos, sin = self.rotary(position_ids)
        for i, layer in enumerate(self.model.layers):
            cache = None if kv_cache is None else (kv_cache.keys[i], kv_cache.values[i])
            x = layer(x, cos, sin, mask, is_causal, cache, cache_start)
        return self.model.norm(x)

    def embed(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        """Input embeddings [..., hidden_size] of tokens at positions (same shapes), in
        `residual_dtype`: the residual stream starts here."""
        x = self.model.embed_tokens(input_ids)
        if self.model.embed_positions is not None:
            x = x + self.model.embed_positions(position_ids)
        return x if self.residual_dtype is None else x.to(self.residual_dtype)

    def rotary(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """`rotate`'s (cos, sin) [..., 1, head_dim] for positions [...], computed in float32 and
        cast to the parameters' dtype; the 1 broadcasts over the heads of `Attention.project`."""
        dtype = self.model.embed_tokens.weight.dtype
        freqs = position_ids.unsqueeze(-1).float() * self._inv_freq_on(position_ids.device)
        cos, sin = freqs.cos(), freqs.sin()
        return (
            torch.cat((cos, cos), dim=-1).to(dtype).unsqueeze(-2),
            torch.cat((-sin, sin), dim=-1).to(dtype).unsqueeze(-2),
        )

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        attn_mask: Tensor | None = None,
        kv_cache: KVCache | None = None,
        cache_start: int = 0,
    ) -> Tensor:
        """Logits [B, T, vocab_size] in float32; arguments as in `hidden_states`."""
        return self.lm_head(
            self.hidden_states(input_ids, position_ids, attn_mask, kv_cache, cache_start)
        ).float()

    def _inv_freq_on(self, device: torch.device) -> Tensor:
        inv_freq = self._inv_freq.get(device)
        if inv_freq is None:
            inv_freq = self._inv_freq[device] = rope_inv_freq(self.config).to(device)
        return inv_freq


def attention_mask(
    key_mask: Tensor | None, t: int, start: int, device: torch.device
) -> tuple[Tensor | None, bool]:
    """SDPA ``(attn_mask, is_causal)`` for T queries at absolute positions [start, start + T)."""
    if key_mask is None:
        if start == 0:
            return None, t > 1
        if t == 1:
            return None, False
    elif t == 1:
        # A single query is the newest position: causality masks nothing.
        return key_mask[:, None, None, :], False
    keys = torch.arange(start + t, device=device)
    queries = torch.arange(start, start + t, device=device).unsqueeze(-1)
    causal = keys <= queries
    if key_mask is None:
        return causal, False
    return (causal & key_mask[:, None, None, :]) | (keys == queries), False


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=_INIT_STD)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=_INIT_STD)


def token_logprobs(
    model: Decoder, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0
) -> Tensor:
    """log p(input_ids[:, t+1] | input_ids[:, :t+1]) under log_softmax(logits / temperature).

    ``input_ids``: [B, T]; ``attention_mask``: [B, T] bool/int, 1 = real token, RIGHT-padded
    (ValueError otherwise). Returns float32 [B, T-1], differentiable w.r.t. the model;
    entries whose target token is padding are 0.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    b, t = input_ids.shape
    real = attention_mask.bool()
    if bool((real[:, 1:] & ~real[:, :-1]).any()):
        raise ValueError("attention_mask must be right-padded (no real token after padding)")
    # Right padding keeps real tokens at positions 0..L-1 and, with causal attention, out of
    # reach of the padding after them, so no key mask is needed. Padding ids are zeroed so
    # any placeholder (e.g. -100) embeds safely.
    ids = input_ids.masked_fill(~real, 0)
    positions = torch.arange(t - 1, device=ids.device).expand(b, t - 1)
    hidden = model.hidden_states(ids[:, :-1], positions)
    return picked_logprobs(hidden, model.lm_head.weight, ids[:, 1:], temperature).masked_fill(
        ~real[:, 1:], 0.0
    )
