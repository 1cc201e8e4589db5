"""Llama/Mistral/Qwen2/Qwen3-family decoder whose state dict equals a Hugging Face checkpoint.

Layout (per ``ModelConfig``): token embedding, ``num_hidden_layers`` pre-norm blocks of
RMSNorm -> grouped-query attention with rotary embeddings (queries and keys RMS-normalised per
head first, with ``qk_norm``) -> residual -> RMSNorm ->
SwiGLU MLP -> residual, a final RMSNorm and an (optionally tied) output projection.

One `DecoderLayer` serves every path (the plain forward, the trainer's prompt-shared pass, the
sampler's prefill and decode): its forward is `layer_project` (input norm, projections,
rotation), then the pass's `LayerAttention` (`attention.py`), then `layer_finish` (output
projection, residuals, MLP), and `Decoder.run_layers` is every path's loop over the layers
except the decode step's (`decode_step.py`), which can run one layer's finish and the next one's
projection as one compiled part.

Parameters. The projections that read the same input are one `nn.Linear` each, so every path
runs one GEMM for them: ``self_attn.qkv_proj`` (rows: q_proj's, k_proj's, v_proj's) and
``mlp.gate_up_proj`` (gate_proj's, up_proj's). ``state_dict()`` lists their rows under Hugging
Face's names (views, no copies) and ``load_state_dict()`` takes those names back
(`_store_as_parts`), so checkpoints and safetensors keep Hugging Face's layout while
``named_parameters()`` (what the optimizer steps and fingerprints probe) names the fused tensors.
"""

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from backends.torch.attention import CausalAttention, LayerAttention
from backends.torch.compiles import training_options
from backends.torch.config import ModelConfig
from backends.torch.logprobs import picked_logprobs

_INIT_STD = 0.02


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Rotary inverse frequencies [head_dim // 2] in float32, after ``rope_scaling``."""
    dim = config.head_dim
    assert dim is not None  # ModelConfig resolves it
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


def _store_as_parts(module: nn.Module, fused: str, parts: dict[str, int]) -> None:
    """Make ``module``'s state dict hold its Linear ``fused`` as the separate projections of
    ``parts`` ({name: rows}, in row order): views of its rows under their names on save, the
    parts concatenated back on load (when all of them are there)."""

    def save(module: nn.Module, state: dict[str, Tensor], prefix: str, metadata: Any) -> None:
        for kind in ("weight", "bias"):
            whole = state.pop(f"{prefix}{fused}.{kind}", None)
            if whole is not None:
                for name, rows in zip(parts, whole.split(list(parts.values())), strict=True):
                    state[f"{prefix}{name}.{kind}"] = rows

    def load(module: nn.Module, state: dict[str, Tensor], prefix: str, *_: Any) -> None:
        for kind in ("weight", "bias"):
            names = [f"{prefix}{name}.{kind}" for name in parts]
            if all(name in state for name in names):
                state[f"{prefix}{fused}.{kind}"] = torch.cat([state.pop(name) for name in names])

    module.register_state_dict_post_hook(save)
    module.register_load_state_dict_pre_hook(load)


class Attention(nn.Module):
    """Grouped-query attention's parameters and its projection; the attention itself is the
    pass's `LayerAttention`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        assert config.head_dim is not None  # ModelConfig resolves it
        self.head_dim = config.head_dim
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.sizes), bias=config.attention_bias)
        _store_as_parts(self, "qkv_proj", dict(zip(("q_proj", "k_proj", "v_proj"), self.sizes, strict=True)))
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated queries [..., T, heads, D] and keys, values [..., T, kv_heads, D] of tokens
        x [..., T, hidden]; `cos`/`sin` [..., T, 1, D] (`Decoder.rotary`)."""
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        lead = q.shape[:-1]
        q = q.view(*lead, self.heads, self.head_dim)
        k = k.view(*lead, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return rotate(q, cos, sin), rotate(k, cos, sin), v.view(*lead, self.kv_heads, self.head_dim)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * size, bias=False)
        _store_as_parts(self, "gate_up_proj", {"gate_proj": size, "up_proj": size})
        self.down_proj = nn.Linear(size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        weight = self.gate_up_proj.weight
        if torch.is_grad_enabled():
            # Training: two GEMMs over the fused weight's halves. The fused GEMM's backward
            # needs its two gradients concatenated, and inductor fuses that cat into a kernel
            # that reads the SwiGLU inputs once for each half: twice the time of the two-output
            # kernel (bench/results-h200.json, session_2026-12-01b).
            size = weight.shape[0] // 2
            gate, up = F.linear(x, weight[:size]), F.linear(x, weight[size:])
        else:
            gate, up = F.linear(x, weight).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


# The parts of a layer around attention, as plain functions of the layer (not methods) so that
# one torch.compile'd version serves every layer (dynamo lifts a layer's parameters to inputs).


def layer_project(
    layer: "DecoderLayer", x: Tensor, cos: Tensor, sin: Tensor, writes: tuple[Tensor, Tensor] | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Input norm, then rotated queries [..., T, heads, D], keys and values [..., T, kv_heads,
    D]; with ``writes`` (`LayerAttention.writes`) the keys, then the values, are also copied
    into its buffer's rows."""
    q, k, v = layer.self_attn.project(layer.input_layernorm(x), cos, sin)
    if writes is not None:
        buffer, rows = writes
        buffer.index_copy_(0, rows, torch.cat((k, v)).view(-1, buffer.shape[-1]))
    return q, k, v


def layer_finish(layer: "DecoderLayer", x: Tensor, out: Tensor) -> Tensor:
    """Output projection of attention's ``out`` [..., T, heads * D], residual, MLP, residual."""
    x = x + layer.self_attn.o_proj(out)
    return x + layer.mlp(layer.post_attention_layernorm(x))


# `layer_project` and `layer_finish`, or versions of them (compiled, `compiled_layer_parts`).
LayerParts = tuple[Callable[..., Any], Callable[..., Any]]
PLAIN_PARTS: LayerParts = (layer_project, layer_finish)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, attention: LayerAttention, index: int, parts: LayerParts
    ) -> Tensor:
        """The residual stream after this layer (layer ``index`` of the model) over x [..., T,
        hidden]: project -> ``attention`` -> finish, through ``parts``."""
        project, finish = parts
        q, k, v = project(self, x, cos, sin, attention.writes(index))
        return finish(self, x, attention(index, q, k, v))


_COMPILED_PARTS: list[Any] = []


def compiled_layer_parts() -> LayerParts:
    """`layer_project` and `layer_finish` through torch.compile (inductor), for any number of
    tokens (dynamo's automatic dynamic shapes), with and without gradients: the trainer's
    `train.compile` and the sampler's prefill share them."""
    if not _COMPILED_PARTS:
        # Dynamo reads the .grad of every tensor it traces, and the residual stream between
        # layers is not a leaf: torch warns of that access at each compile, needlessly.
        warnings.filterwarnings("ignore", "The .grad attribute of a Tensor that is not a leaf", UserWarning)
        _COMPILED_PARTS.extend(torch.compile(f, options=training_options()) for f in PLAIN_PARTS)
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

    def run_layers(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        attention: LayerAttention,
        parts: LayerParts = PLAIN_PARTS,
        *,
        checkpointed: bool = False,
    ) -> Tensor:
        """The residual stream [..., T, hidden] after every layer (before the final norm), from
        the embeddings ``x`` (`embed`) and `rotary`'s ``cos``/``sin`` of the same T tokens.
        ``checkpointed`` (with gradients) keeps only each layer's input for the backward pass
        and recomputes the layer there."""
        for index, layer in enumerate(self.model.layers):
            if checkpointed and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, attention, index, parts, use_reentrant=False)
            else:
                x = layer(x, cos, sin, attention, index, parts)
        return x

    def hidden_states(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        """Final-norm hidden states [B, T, hidden_size] in the model dtype, causal over each row
        of ``input_ids``/``position_ids`` ([B, T] integer tensors)."""
        cos, sin = self.rotary(position_ids)
        attention = CausalAttention(None, input_ids.shape[1] > 1)
        return self.model.norm(self.run_layers(self.embed(input_ids, position_ids), cos, sin, attention))

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

    def forward(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        """Logits [B, T, vocab_size] in float32; arguments as in `hidden_states`."""
        return self.lm_head(self.hidden_states(input_ids, position_ids)).float()

    def _inv_freq_on(self, device: torch.device) -> Tensor:
        inv_freq = self._inv_freq.get(device)
        if inv_freq is None:
            inv_freq = self._inv_freq[device] = rope_inv_freq(self.config).to(device)
        return inv_freq


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
