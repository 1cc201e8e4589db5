"""megatron-core's dynamic inference engine on the megatron trainer's own `GPTModel`
(`rollout.engine: megatron`), behind `MegatronInference`.

No weights move: the engine runs the module the trainer steps, so a wake serves the new weights
(`wake_carries_weights`). Its pieces, as megatron 0.19 wires them (the construction a probe on
the H200 ran): an `InferenceConfig`, the `DynamicInferenceContext` that holds the paged KV cache,
`GPTInferenceWrapper` over the model, a `TextGenerationController` (with a stand-in tokenizer:
the pipeline passes token ids) and the `DynamicInferenceEngine`. Attention inside it calls
flash-attn's functions, answered by torch's flash kernels where flash-attn is missing
(`flash_adapter`).

- KV cache: `kv_cache_management_mode` recompute. The gate drains the requests in flight
  before each stand-down, so `suspend()` frees the cache with nothing to recompute, where offload
  would copy the whole cache to host memory and back at every step. Its size
  (`kv_cache_bytes`): `rollout.kv_cache_gb` when set, else the rows in flight at once
  (`rollout.max_rows`, else prompts_per_step x samples_per_prompt x (L + 1): megatron's
  `max_requests`, the rest wait in its queue) times 2 x max_new_tokens tokens each (room
  for a prompt as long as the response), rounded up to whole 256-token blocks, times the
  model's KV bytes per token (2 x layers x kv_heads x head_dim x the dtype's bytes). Rows past
  that wait in megatron's queue (it pauses requests the cache cannot hold); a single row longer
  than the whole cache could never run, so `max_sequence_length` is bounded by it too.
- Stand-down: megatron's `suspend()` frees the cache's tensors, then calls
  `delete_cuda_graphs()`, which also runs `gc.collect()` and `torch.cuda.empty_cache()`
  whether or not any graph was captured: 146-354 ms a stand-down on the H200 with the pipeline's
  heap. This engine captures no graphs (megatron's `cuda_graph_impl` is left off), so
  `install_suspend` puts `empty_cache_unless_graphs` in its place in the engine's module: the
  cache still goes back to the driver, the collection is skipped, and an engine that did capture
  graphs has them deleted by megatron's own function as before.
- Sampling (`sampling_params`): the recipe's temperature with neither top-k nor top-p
  (`backends/megatron/rules.py` refuses top_p < 1 and temperature 0); greedy requests (evaluation) take
  megatron's greedy draw, top_k 1. One termination id, the tokenizer's one stop token (megatron
  takes no more: several are refused).
- Logprobs: `logprobs_mode` "processed_logprobs", the log-softmax of the logits divided by the
  temperature, which is what the torch engine reports and the trainer recomputes (megatron's
  default, "raw_logprobs", is the temperature-1 distribution's). A greedy token's logprob is 0
  (the top-1 distribution's), where the torch engine gives the temperature-1 one; only
  evaluations generate greedily, and they read no logprobs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from megatron.core.inference.config import InferenceConfig, KVCacheManagementMode
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron.core.inference.engines import dynamic_engine as engine_module
from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
    GPTInferenceWrapper,
)
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)
from megatron.core.transformer import cuda_graphs

from backends.bench_lengths import length_draw
from backends.input import Input
from backends.megatron import flash_adapter
from backends.megatron.inference import MegatronInference
from backends.torch.config import ModelConfig
from pipeline.contracts.backend_input import Sampling
from pipeline.contracts.errors import RecipeError

BLOCK_TOKENS = 256  # megatron's default KV block


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Keys and values of every layer for one token (one tensor-parallel rank)."""
    assert config.head_dim is not None  # ModelConfig resolves it
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype.itemsize


def rows_in_flight(sampling: Sampling) -> int:
    """The most rows generating at once (megatron's `max_requests`): `rollout.max_rows`, else
    L + 1 batches admitted (at most run.steps), each of every sample."""
    return sampling.max_rows or sampling.rows_admitted


def kv_cache_bytes(sampling: Sampling, config: ModelConfig, dtype: torch.dtype) -> int:
    """The KV cache's size (module docstring); with megatron's one reserved block."""
    if sampling.kv_cache_gb:
        return int(sampling.kv_cache_gb * 2**30)
    tokens = min(2 * sampling.max_new_tokens, config.max_position_embeddings)
    blocks = rows_in_flight(sampling) * math.ceil(tokens / BLOCK_TOKENS) + 1
    return blocks * BLOCK_TOKENS * kv_bytes_per_token(config, dtype)


def termination_id(stop_ids: Sequence[int]) -> int:
    """The one token that ends a request (-1: none)."""
    if len(stop_ids) > 1:
        listed = ", ".join(str(i) for i in stop_ids)
        raise RecipeError(
            f"rollout.engine: megatron ends a request at one token id (megatron's termination_id), "
            f"but the model's tokenizer has {len(stop_ids)} stop tokens ({listed}); use "
            "rollout.engine: torch"
        )
    return stop_ids[0] if stop_ids else -1


def sampling_params(greedy: bool, limit: int, *, temperature: float, termination: int) -> SamplingParams:
    """One request's parameters: `limit` new tokens at most, each with its logprob."""
    return SamplingParams(
        temperature=1.0 if greedy else temperature,
        top_k=1 if greedy else 0,
        top_p=0.0,  # megatron's "off"
        return_log_probs=True,
        skip_prompt_log_probs=True,
        num_tokens_to_generate=limit,
        termination_id=termination,
    )


class _Tokens:
    """The tokenizer megatron's controller holds: requests arrive as token ids, and the text it
    detokenizes finished requests into is never read."""

    bos = None

    def __init__(self, eod: int, vocab_size: int) -> None:
        self.eod = eod
        self.vocab_size = vocab_size

    def detokenize(self, tokens: Sequence[int]) -> str:
        return ""

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError("the pipeline sends token ids")


def _kv_cache_in_use(engine: Any) -> int:
    """Bytes the KV cache holds (0 once `suspend()` has let it go)."""
    buffer = getattr(engine.context, "memory_buffer", None)
    return 0 if buffer is None else buffer.numel() * buffer.element_size()


def inference_config(sampling: Sampling, config: ModelConfig, dtype: torch.dtype) -> InferenceConfig:
    """The engine's configuration for this recipe's batches (module docstring)."""
    rollout = sampling
    cache = kv_cache_bytes(sampling, config, dtype)
    block_bytes = BLOCK_TOKENS * kv_bytes_per_token(config, dtype)
    max_sequence_length = min(config.max_position_embeddings, (cache // block_bytes - 1) * BLOCK_TOKENS)
    if max_sequence_length <= rollout.max_new_tokens:
        raise RecipeError(
            f"rollout.kv_cache_gb: {rollout.kv_cache_gb:g} holds {max(max_sequence_length, 0)} tokens "
            f"of this model, not one prompt and rollout.max_new_tokens {rollout.max_new_tokens}: "
            "raise it, or leave it at 0 (derived from the batch)"
        )
    rows = rows_in_flight(sampling)
    return InferenceConfig(
        block_size_tokens=BLOCK_TOKENS,
        buffer_size_gb=cache / 2**30,
        max_requests=rows,
        # Prefill takes whole prompts (no chunking): any that fits a row fits a step.
        max_tokens=max(DynamicInferenceContext.DEFAULT_MAX_TOKENS, max_sequence_length, rows),
        max_sequence_length=max_sequence_length,
        kv_cache_management_mode=KVCacheManagementMode.RECOMPUTE,
        materialize_only_last_token_logits=True,
        logprobs_mode="processed_logprobs",
    )


def empty_cache_unless_graphs() -> None:
    """What megatron's `suspend()` calls after freeing the KV cache (module docstring): its own
    `delete_cuda_graphs` where megatron recorded graphs, else only `torch.cuda.empty_cache()`."""
    record = cuda_graphs._CudagraphGlobalRecord
    if record.cudagraph_record or record.cudagraph_inference_record:
        cuda_graphs.delete_cuda_graphs()
    else:
        torch.cuda.empty_cache()


def install_suspend() -> None:
    """Make megatron's `suspend()` call `empty_cache_unless_graphs` (idempotent)."""
    engine_module.delete_cuda_graphs = empty_cache_unless_graphs


def dynamic_engine(
    model: Any, inference: InferenceConfig, *, tokens: _Tokens, seed: int, device: torch.device
) -> DynamicInferenceEngine:
    """megatron's engine over `model`; called on the engine's own thread."""
    flash_adapter.install()
    install_suspend()
    torch.cuda.set_device(device)  # this thread's: megatron allocates on the current device
    context = DynamicInferenceContext(model.config, inference)
    controller = TextGenerationController(GPTInferenceWrapper(model, context), tokens)
    controller.sampling_rng.manual_seed(seed)
    return DynamicInferenceEngine(controller, context)


def build_inference(
    model: Any, config: ModelConfig, spec: Input, *, stop_ids: Sequence[int], device: torch.device
) -> MegatronInference:
    """`MegatronInference` over a `DynamicInferenceEngine` serving `model` in place."""
    rollout = spec.sampling
    termination = termination_id(stop_ids)
    inference = inference_config(rollout, config, model.config.params_dtype)
    tokens = _Tokens(termination, config.vocab_size)
    seed = spec.seed + 1  # the torch engine's
    return MegatronInference(
        lambda: dynamic_engine(model, inference, tokens=tokens, seed=seed, device=device),
        sampling=functools.partial(sampling_params, temperature=rollout.temperature, termination=termination),
        stop_token_ids=stop_ids,
        max_new_tokens=rollout.max_new_tokens,
        max_sequence_length=inference.max_sequence_length,
        lengths=length_draw(rollout, seed=spec.seed),
        memory_in_use=_kv_cache_in_use,
        generator=lambda engine: engine.controller.sampling_rng,
        # megatron's inference attention asserts eval mode; the trainer's step sets train mode
        # again (colocated, the two never run at once).
        serving=model.eval,
    )
