"""A megatron-core `GPTModel` of the torch backend's `ModelConfig`.

Llama, Mistral (no window), Qwen2 (q/k/v biases) and Qwen3 (q/k RMSNorm per head): RMSNorm,
SwiGLU, grouped-query attention, rotary embeddings, tied or untied output projection, dropout
off. The local layer spec (no TransformerEngine) with `SdpaAttention` as core attention.

Two things megatron models differently are set after construction, so that the model computes
exactly what `backends.torch.model.Decoder` computes:
  * rotary frequencies: megatron knows rope_theta and a fixed llama3 scaling; its inverse
    frequencies are replaced by the torch backend's (`rope_inv_freq`: theta, linear, llama3);
  * `learned_position_embeddings` (the CPU digit tasks' table beside rotary; GPTModel takes one
    or the other): the embedding gets a position table, which it adds when asked to.

Built in the current megatron process groups (`backends.megatron.parallel.initialise`); with
tensor parallelism each rank holds its shard (`backends.megatron.layout` says which).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

from backends.megatron.attention import SdpaAttention
from backends.torch.compiles import training_options
from backends.torch.config import ModelConfig
from backends.torch.model import rope_inv_freq

INIT_STD = 0.02  # the torch backend's


def transformer_config(
    config: ModelConfig, *, dtype: torch.dtype, device: torch.device, tensor_parallel: int
) -> TransformerConfig:
    return TransformerConfig(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_key_value_heads,
        kv_channels=config.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=config.attention_bias,
        qk_layernorm=config.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=INIT_STD,
        tensor_model_parallel_size=tensor_parallel,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=device.type == "cpu",
        # Fused kernels are CUDA/TransformerEngine code; the unfused paths are plain torch.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


def build_gpt_model(
    config: ModelConfig, *, dtype: torch.dtype, device: torch.device, tensor_parallel: int = 1
) -> GPTModel:
    """A randomly initialised model on `device` (load weights with `layout.load_hf`)."""
    if config.vocab_size % tensor_parallel:
        raise ValueError(
            f"vocab_size ({config.vocab_size}) must be a multiple of the tensor parallel size "
            f"({tensor_parallel})"
        )
    # GPTModel logs its deprecation (in favour of HybridModel, whose stock specs need
    # TransformerEngine) as a warning at every construction.
    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_norm)
    spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    model = GPTModel(
        config=transformer_config(config, dtype=dtype, device=device, tensor_parallel=tensor_parallel),
        transformer_layer_spec=spec,
        vocab_size=config.vocab_size,
        max_sequence_length=config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(config.rope_theta),
        share_embeddings_and_output_weights=config.tie_word_embeddings,
    ).to(device=device, dtype=dtype)  # the local spec's norms are built in float32 whatever params_dtype says
    model.rotary_pos_emb.inv_freq = rope_inv_freq(config).to(device)
    if config.learned_position_embeddings:
        table = torch.nn.Embedding(
            config.max_position_embeddings, config.hidden_size, device=device, dtype=dtype
        )
        torch.nn.init.normal_(table.weight, std=INIT_STD)
        model.embedding.position_embeddings = table
        model.embedding.add_position_embedding = True
    return model


def compile_layers(model: GPTModel) -> None:
    """`train.compile`: each TransformerLayer torch.compile'd whole (fused norms, rotary, SwiGLU
    around its SDPA core) for training. Called by megatron's inference engine (with an inference
    context: paged KV cache, flash-attention calls, host-side bookkeeping) a layer runs eagerly."""
    for layer in model.decoder.layers:
        layer.compile(options=training_options())
        layer._compiled_call_impl = _CompiledForTraining(layer._compiled_call_impl, layer._call_impl)


class _CompiledForTraining:
    def __init__(self, compiled: Any, eager: Any) -> None:
        self.compiled = compiled
        self.eager = eager

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("inference_context") is not None:
            return self.eager(*args, **kwargs)
        return self.compiled(*args, **kwargs)
