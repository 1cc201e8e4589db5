"""Hugging Face parameter names and layouts <-> megatron-core `GPTModel`'s, per tensor-parallel rank.

The torch backend's `Decoder.state_dict()` is the Hugging Face layout. Megatron fuses and shards:

  * `linear_qkv` holds, for each query group (key/value head) in order, its query heads, then
    its key head, then its value head ([groups * (heads/groups + 2) * head_dim, hidden]; the
    biases the same way); rank r of T holds groups [r G/T, (r+1) G/T).
  * `linear_fc1` is [gate; up]; rank r holds [gate rows of r; up rows of r].
  * Column-parallel weights (`linear_qkv`, `linear_fc1`, the word embedding and the output
    layer, by vocabulary rows) split their rows; row-parallel ones (`linear_proj`,
    `linear_fc2`) their columns; norms and the learned position table are whole on every rank.
  * Tied embeddings have no `output_layer.weight`; `lm_head.weight` is the embedding.

`to_megatron(hf, config, rank, size)` is rank r's state dict; `to_hf(shards, config)` merges all
ranks' back. Both only slice, concatenate and reshape, so round trips are exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from backends.torch.config import ModelConfig

# Per-layer names: Hugging Face suffix -> megatron suffix, for tensors that map one to one.
_COLUMN = {
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
}
_WHOLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
}
_TOP_ROWS = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "lm_head.weight": "output_layer.weight",
}
_TOP_WHOLE = {
    "model.norm.weight": "decoder.final_layernorm.weight",
    "model.embed_positions.weight": "embedding.position_embeddings.weight",
}


def _shape(config: ModelConfig) -> tuple[int, int, int]:
    """(query groups, query heads per group, head_dim)."""
    assert config.head_dim is not None  # ModelConfig resolves it
    groups = config.num_key_value_heads
    return groups, config.num_attention_heads // groups, config.head_dim


def _qkv_fuse(q: Tensor, k: Tensor, v: Tensor, config: ModelConfig) -> Tensor:
    """Fused [groups * (per + 2) * d, ...] from q [heads * d, ...], k and v [groups * d, ...]."""
    groups, per, d = _shape(config)
    per = config.num_attention_heads // groups
    rest = q.shape[1:]
    return torch.cat(
        [q.reshape(groups, per * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1
    ).reshape(-1, *rest)


def _qkv_split(fused: Tensor, config: ModelConfig) -> tuple[Tensor, Tensor, Tensor]:
    groups, per, d = _shape(config)
    rest = fused.shape[1:]
    q, k, v = fused.reshape(groups, (per + 2) * d, *rest).split([per * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def to_megatron(
    hf: Mapping[str, Tensor], config: ModelConfig, *, rank: int = 0, size: int = 1
) -> dict[str, Tensor]:
    """Rank `rank`'s shard (of `size`) of the Hugging Face state dict `hf`, in megatron's names."""

    def rows(t: Tensor) -> Tensor:
        return t.chunk(size, dim=0)[rank]

    out: dict[str, Tensor] = {}
    for name, target in _TOP_ROWS.items():
        if name in hf and not (name == "lm_head.weight" and config.tie_word_embeddings):
            out[target] = rows(hf[name])
    out.update({target: hf[name] for name, target in _TOP_WHOLE.items() if name in hf})
    for i in range(config.num_hidden_layers):
        hf_at, mg_at = f"model.layers.{i}.", f"decoder.layers.{i}."
        for name, target in _WHOLE.items():
            if hf_at + name in hf:
                out[mg_at + target] = hf[hf_at + name]
        for name, target in _COLUMN.items():
            out[mg_at + target] = hf[hf_at + name].chunk(size, dim=1)[rank]
        for kind in ("weight", "bias") if config.attention_bias else ("weight",):
            q, k, v = (hf[f"{hf_at}self_attn.{p}_proj.{kind}"] for p in "qkv")
            out[f"{mg_at}self_attention.linear_qkv.{kind}"] = rows(_qkv_fuse(q, k, v, config))
        gate, up = (hf[f"{hf_at}mlp.{p}_proj.weight"] for p in ("gate", "up"))
        out[mg_at + "mlp.linear_fc1.weight"] = torch.cat([rows(gate), rows(up)])
    return out


def to_hf(shards: Sequence[Mapping[str, Tensor]], config: ModelConfig) -> dict[str, Tensor]:
    """The Hugging Face state dict of every rank's megatron state dict (rank order)."""
    first = shards[0]

    def rows(name: str) -> Tensor:
        return torch.cat([s[name] for s in shards])

    out: dict[str, Tensor] = {}
    for name, source in _TOP_ROWS.items():
        if source in first:
            out[name] = rows(source)
    if config.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    out.update({name: first[source] for name, source in _TOP_WHOLE.items() if source in first})
    for i in range(config.num_hidden_layers):
        hf_at, mg_at = f"model.layers.{i}.", f"decoder.layers.{i}."
        for name, source in _WHOLE.items():
            if mg_at + source in first:
                out[hf_at + name] = first[mg_at + source]
        for name, source in _COLUMN.items():
            out[hf_at + name] = torch.cat([s[mg_at + source] for s in shards], dim=1)
        for kind in ("weight", "bias") if config.attention_bias else ("weight",):
            q, k, v = _qkv_split(rows(f"{mg_at}self_attention.linear_qkv.{kind}"), config)
            out.update(
                {f"{hf_at}self_attn.{p}_proj.{kind}": t for p, t in zip("qkv", (q, k, v), strict=True)}
            )
        halves = [s[mg_at + "mlp.linear_fc1.weight"].chunk(2) for s in shards]
        out[hf_at + "mlp.gate_proj.weight"] = torch.cat([gate for gate, _ in halves])
        out[hf_at + "mlp.up_proj.weight"] = torch.cat([up for _, up in halves])
    return out


def parameters(model: torch.nn.Module) -> dict[str, Tensor]:
    """The model's parameters by name (no `_extra_state` entries, no rotary buffer)."""
    return dict(model.named_parameters())


@torch.no_grad()
def load_hf(
    model: torch.nn.Module, hf: Mapping[str, Tensor], config: ModelConfig, *, rank: int = 0, size: int = 1
) -> None:
    """Copy the Hugging Face state dict `hf` into this rank's `GPTModel`; every parameter must be set."""
    shard = to_megatron(hf, config, rank=rank, size=size)
    own = parameters(model)
    if set(shard) != set(own):
        raise ValueError(
            f"megatron parameters {sorted(set(own) ^ set(shard))} do not match the Hugging Face ones"
        )
    for name, value in shard.items():
        own[name].copy_(value)
