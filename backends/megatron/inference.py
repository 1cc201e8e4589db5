"""megatron-core's dynamic inference engine as the torch engine's sampler, colocated with training.

`MegatronSampler` serves the trainer's own megatron module (so a wake carries the new weights):
`TorchEngine` batches the pipeline's requests into its `generate` calls on the engine's compute
thread, which runs megatron's step loop (`DynamicInferenceEngine.generate`) to the batch's end;
`release` is megatron's `suspend()` (the KV cache's memory goes back, how depends on
`kv_cache_management_mode`) and `wake` its `resume()`. Megatron's engine keeps an asyncio loop
of its own, created in the thread that builds it and never run: build it off the pipeline's
event loop (start-up runs in a worker thread).

Logprobs are megatron's raw ones (temperature 1) when sampling at temperature 1 or greedily, and
its processed ones (log_softmax(logits / T)) at another temperature, the torch sampler's
convention; top-p below 1 with a temperature other than 1 is refused, since megatron's
processed logprobs are those of the truncated distribution.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from backends.torch.fingerprint import Probe
from pipeline.messages import Completion


class DynamicEngine(Protocol):
    """What the sampler uses of megatron's `DynamicInferenceEngine` (or the testing fake)."""

    def generate(self, prompts: list[list[int]], sampling_params: Any) -> list[Any]: ...

    def suspend(self) -> None: ...

    def resume(self) -> None: ...


# (temperature, top_k, top_p, max_new_tokens, termination_id) -> megatron SamplingParams
ParamsFactory = Callable[[float, int, float, int, int], Any]


class MegatronSampler:
    def __init__(
        self,
        engine: DynamicEngine,
        model: torch.nn.Module,
        *,
        params: ParamsFactory,
        position_limit: int | None,
        cache_bytes: Callable[[], int],
    ) -> None:
        self.engine = engine
        self.model = model
        self.device = next(model.parameters()).device
        self.position_limit = position_limit
        self.layout = 0
        self._params = params
        self._cache_bytes = cache_bytes
        self._down = False

    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] = (),
        generator: torch.Generator | None = None,  # megatron draws from its own generator
    ) -> list[Completion]:
        if temperature not in (0.0, 1.0) and top_p < 1.0:
            raise NotImplementedError(
                "megatron inference: top_p < 1 needs temperature 1 (its processed logprobs are "
                "those of the truncated distribution)"
            )
        self.wake()
        greedy = temperature == 0
        termination = stop_token_ids[0] if stop_token_ids else -1
        params = self._params(
            1.0 if greedy else temperature, 1 if greedy else 0, 0.0 if top_p >= 1 else top_p,
            max_new_tokens, termination,
        )
        records = self.engine.generate(prompts, params)
        if len(records) != len(prompts):
            raise RuntimeError(f"megatron inference returned {len(records)} results for {len(prompts)} prompts")
        return [_completion(record, set(stop_token_ids)) for record in records]

    def release(self) -> None:
        if not self._down:
            self.engine.suspend()
            self._down = True

    def wake(self) -> None:
        if self._down:
            self.engine.resume()
            self._down = False

    def refresh(self) -> None:
        """Nothing to copy: the engine runs the trainer's module itself."""

    def cache_bytes(self) -> int:
        return 0 if self._down else self._cache_bytes()

    def probes(self) -> list[Probe]:
        return []


def _completion(record: Any, stop_ids: set[int]) -> Completion:
    """A finished megatron request as a Completion, cut after its first stop token (megatron
    terminates on one token id; the others end the completion here)."""
    merged = record.merge()
    tokens = list(merged.generated_tokens)
    logprobs = list(merged.generated_log_probs or [])
    if len(logprobs) != len(tokens):
        raise RuntimeError(f"megatron inference returned {len(logprobs)} logprobs for {len(tokens)} tokens")
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return Completion(tokens=tuple(tokens[: i + 1]), logprobs=tuple(logprobs[: i + 1]), finish_reason="stop")
    return Completion(tokens=tuple(tokens), logprobs=tuple(logprobs), finish_reason="length")


def megatron_sampler(
    model: torch.nn.Module,
    *,
    max_requests: int,
    max_sequence_length: int,
    buffer_gib: float,
    kv_cache: str,
    temperature: float,
    vocab_size: int,
    position_limit: int | None,
) -> MegatronSampler:
    """A `MegatronSampler` over megatron's dynamic engine serving `model` (a megatron
    `GPTModel`, on CUDA; megatron's model parallel state initialised). `kv_cache`: megatron's
    `kv_cache_management_mode` at suspend, "recompute" (free the KV cache, requests in flight
    start again) or "offload" (copy it to host memory and back)."""
    from backends.megatron.flash_adapter import install

    install()
    from megatron.core.inference.config import InferenceConfig, KVCacheManagementMode
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
        GPTInferenceWrapper,
    )
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    config = InferenceConfig(
        block_size_tokens=256,
        buffer_size_gb=buffer_gib,
        max_requests=max_requests,
        max_sequence_length=max_sequence_length,
        kv_cache_management_mode=KVCacheManagementMode(kv_cache),
        materialize_only_last_token_logits=True,
        logprobs_mode="raw_logprobs" if temperature in (0.0, 1.0) else "processed_logprobs",
    )
    context = DynamicInferenceContext(model.config, config)
    controller = TextGenerationController(GPTInferenceWrapper(model, context), _TokenIds(vocab_size))
    engine = DynamicInferenceEngine(controller, context)

    def params(temperature: float, top_k: int, top_p: float, new_tokens: int, termination: int) -> Any:
        return SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, return_log_probs=True,
            skip_prompt_log_probs=True, num_tokens_to_generate=new_tokens, termination_id=termination,
        )

    def cache_bytes() -> int:
        return context.memory_buffer.numel() * context.memory_buffer.element_size()

    return MegatronSampler(engine, model, params=params, position_limit=position_limit, cache_bytes=cache_bytes)


class _TokenIds:
    """The tokenizer megatron's controller asks for: prompts arrive as token ids and results
    leave as token ids, so it only names the vocabulary and detokenizes to nothing."""

    bos = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eod = -1  # every request names its own termination id

    def detokenize(self, tokens: Any, **_: Any) -> str:
        return ""

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError("megatron inference here takes token ids, not text")
