"""megatron-core's dynamic inference engine on the megatron trainer's own `GPTModel`
(`rollout.engine: megatron`), behind `MegatronInference`.

Colocated no weights move: the engine runs the module the trainer steps, so a wake serves the
new weights (`wake_carries_weights`), with nothing to check at the hand-off: it reports no
fingerprint, and the gate's handoff checks leave it unchecked.
Apart (`colocated: false`) it runs a model of its own (`apart.EngineCopy`), refreshed from the
trainer's after each step (`MegatronInference.refit`); as a Ray replica, from the weights it was
sent (`apart.ReplicaCopy`). On Ray, colocated, each trainer rank's actor builds it as here.
With partial rollouts the gate stands it down with requests in flight: they rely on recompute
(below), and `drop_pending_forward` runs before each suspend. Its pieces, as megatron 0.19
wires them (the construction a probe on the H200 ran): an `InferenceConfig`, the
`DynamicInferenceContext` that holds the paged KV cache, `GPTInferenceWrapper` over the model,
a `TextGenerationController` (with a stand-in tokenizer: the pipeline passes token ids) and the
`DynamicInferenceEngine`. Attention inside it calls flash-attn's functions, answered by torch's
flash kernels and a Triton decode kernel where flash-attn is missing (`flash_adapter`).

- CUDA graphs (`rollout.graphs`, off by default, the fast path on a GPU; `KVHandoff`):
  megatron captures its decoder block (all layers) once per decode batch size, a power of two
  rows up to `max_requests`
  (`num_cuda_graphs` -1), when the engine is built, and replays them for decode-only steps;
  prefill steps, the embedding, the output layer, sampling and megatron's bookkeeping run
  eagerly. The graphs are set on the trainer's model for as long as the engine serves
  (`KVHandoff.attach`: `cuda_graph_impl` "local", `inference_cuda_graph_scope` block, a graph
  manager on the block kept outside its children); the block replays only with megatron's
  inference mode on and an inference context, so the trainer's forward stays eager. A graphed
  decode step attends through the flash adapter's Triton kernel, which reads each row's own
  blocks; where that kernel cannot run, the adapter's gather cannot size its key copy to the
  rows and copies `max_sequence_length` keys per row, so that length is bounded to a row's room
  in the derived cache (`row_tokens`, 2 x max_new_tokens: a longer prompt is refused). The RNG
  tracker's tensor states are left out of each capture (`_graph_safe_rng_states`): nothing in
  the block draws random numbers.
- KV cache, graphed: `kv_cache_management_mode` persist (megatron keeps the cache's tensor and
  the graphs across `suspend()`), with the cache's memory in a `VirtualMemoryPool`
  (`pool_cache`) that `KVHandoff` unmaps after each `suspend()` and maps again at the same
  address before each `resume()`, so the graphs stay valid with the memory back with the
  driver while the trainer steps. A request still in the cache at a stand-down (the gate drains
  them first) keeps it mapped. Without graphs: recompute. The gate drains the requests in flight
  before each stand-down, so `suspend()` frees the cache with nothing to recompute, where offload
  would copy the whole cache to host memory and back at every step; with partial rollouts the
  requests in flight are recomputed at the resume under the new weights (persist would continue
  them over keys of the old weights, their cache held through the train step: `rules` refuses
  partial rollouts with graphs). Its size
  (`kv_cache_bytes`): `rollout.kv_cache_gb` when set, else the rows in flight at once
  (`rollout.max_rows`, else prompts_per_step x samples_per_prompt x (L + 1): megatron's
  `max_requests`, the rest wait in its queue) times 2 x max_new_tokens tokens each (room
  for a prompt as long as the response), rounded up to whole 256-token blocks, times the
  model's KV bytes per token (2 x layers x kv_heads x head_dim x the dtype's bytes). Rows past
  that wait in megatron's queue (it pauses requests the cache cannot hold); a single row longer
  than the whole cache could never run, so `max_sequence_length` is bounded by it too.
- Stand-down without graphs: megatron's `suspend()` frees the cache's tensors, then calls
  `delete_cuda_graphs()`, which also runs `gc.collect()` and `torch.cuda.empty_cache()`
  whether or not any graph was captured: 146-354 ms a stand-down on the H200 with the pipeline's
  heap. Such an engine captures no graphs, so `install_suspend` puts `empty_cache_unless_graphs`
  in its place in the engine's module: the cache still goes back to the driver, the collection
  is skipped, and an engine that did capture graphs has them deleted by megatron's own function
  as before. A graphed engine's `suspend()` (persist) deletes nothing; its close does
  (`KVHandoff.close`).
- Schedule (`Serving.schedule`): megatron's async schedule (`async_sched_mode` async). Its
  legacy one runs each step in order on the host: launch the forward, wait for the sampled
  tokens, then the logprobs and the bookkeeping over every request, with the GPU idle from
  the wait to the next launch. The async one, on a decode step with nothing to admit or pause,
  samples step N and launches step N+1's forward (its input tokens copied on the GPU) before
  it resolves step N on the host (finished requests, logprobs, megatron's per-request
  bookkeeping), so that host work overlaps the next forward; a step that admits, pauses or
  prefills runs in order, and one where some rows finish and others go on waits for the next
  forward (megatron compacts its logits to the survivors with a blocking index copy). Its
  sampled tokens are the legacy schedule's (megatron keeps the rows in the legacy order, and
  the draws are the same).
- Sampling (`backends/megatron/sampling.py`): each request's parameters (`sampling_params`:
  the recipe's temperature and top-p; greedy requests, an evaluation's or
  `rollout.temperature: 0`, megatron's top-1 draw), drawn by `RaceSampling`, the torch engine's
  draw with no host sync (what the async schedule needs), and `logprobs_mode`
  "processed_logprobs" answered by it: the logprobs the torch engine reports and the trainer
  recomputes. Bench variants (`Serving.sampler`): "fused", `FusedRaceSampling` (the torch
  engine's one-pass CUDA draw on a training batch's steps); "megatron", megatron's
  `TorchSampling` (its draw waits for the GPU, its logprobs are of the renormalised nucleus, 0
  for a greedy token). One termination id, the tokenizer's one stop token (megatron takes no more:
  several are refused).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import torch
from megatron.core.inference.config import AsyncScheduleMode, InferenceConfig, KVCacheManagementMode
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron.core.inference.engines import dynamic_engine as engine_module
from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
    GPTInferenceWrapper,
)
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer import cuda_graphs
from megatron.core.transformer.enums import InferenceCudaGraphScope

from backends.bench_lengths import length_draw
from backends.input import Input
from backends.megatron import flash_adapter, inference_mode
from backends.megatron.apart import EngineCopy, ReplicaCopy
from backends.megatron.inference import MegatronInference
from backends.megatron.sampling import FusedRaceSampling, RaceSampling, sampling_params
from backends.torch.config import ModelConfig
from backends.torch.kv_pool import KVPool, VirtualMemoryPool
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


def row_tokens(sampling: Sampling, config: ModelConfig) -> int:
    """One row's room in the derived cache: 2 x max_new_tokens (a prompt as long as the
    response), within the model's positions, in whole blocks."""
    tokens = min(2 * sampling.max_new_tokens, config.max_position_embeddings)
    return math.ceil(tokens / BLOCK_TOKENS) * BLOCK_TOKENS


def kv_cache_bytes(sampling: Sampling, config: ModelConfig, dtype: torch.dtype) -> int:
    """The KV cache's size (module docstring); with megatron's one reserved block."""
    if sampling.kv_cache_gb:
        return int(sampling.kv_cache_gb * 2**30)
    blocks = rows_in_flight(sampling) * row_tokens(sampling, config) // BLOCK_TOKENS + 1
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


class Serving(NamedTuple):
    """How the engine steps: the pipeline serves with the defaults; the bench also times the
    others (`bench/megatron_inference.py`). `schedule`: megatron's `async_sched_mode`;
    `sampler`: "race" (`RaceSampling`), "fused" (`FusedRaceSampling`) or "megatron" (its own
    `TorchSampling`)."""

    schedule: AsyncScheduleMode = AsyncScheduleMode.ASYNC
    sampler: Literal["race", "fused", "megatron"] = "race"


SERVING = Serving()  # the pipeline's


def inference_config(
    sampling: Sampling,
    config: ModelConfig,
    dtype: torch.dtype,
    *,
    schedule: AsyncScheduleMode = AsyncScheduleMode.ASYNC,
) -> InferenceConfig:
    """The engine's configuration for this recipe's batches (module docstring)."""
    rollout = sampling
    cache = kv_cache_bytes(sampling, config, dtype)
    block_bytes = BLOCK_TOKENS * kv_bytes_per_token(config, dtype)
    max_sequence_length = min(config.max_position_embeddings, (cache // block_bytes - 1) * BLOCK_TOKENS)
    if rollout.graphs:  # a graphed step's gather copies this many keys per row (module docstring)
        max_sequence_length = min(max_sequence_length, row_tokens(sampling, config))
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
        # Graphs: megatron keeps the cache and its graphs across suspend(); `KVHandoff` hands
        # the cache's memory back to the driver itself, at the same address.
        kv_cache_management_mode=(
            KVCacheManagementMode.PERSIST if rollout.graphs else KVCacheManagementMode.RECOMPUTE
        ),
        num_cuda_graphs=-1 if rollout.graphs else None,  # -1: a decode graph per power of 2 rows
        use_cuda_graphs_for_non_decode_steps=False,  # prefill steps run eagerly
        materialize_only_last_token_logits=True,
        logprobs_mode="processed_logprobs",
        async_sched_mode=schedule,
    )


def drop_pending_forward(engine: Any) -> None:
    """Before a suspend with requests in flight (partial rollouts): megatron's async schedule
    ends a step with the next token's forward launched and its logits kept for the next step to
    sample (the controller's `_async_sched_logits`), which megatron's suspend leaves in place.
    The recompute suspend checkpoints each request at its tokens drawn so far, and the resume
    computes the next token's logits again under the new weights: the old weights' are dropped,
    as megatron drops them itself when a step finds no request left."""
    engine.controller._async_sched_logits.clear()


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


def pool_cache(context: Any, pool: KVPool) -> None:
    """Move the context's KV cache (`memory_buffer`, empty yet) into `pool`: same shape and
    dtype, its memory the pool's. Done after megatron builds the context, not by a subclass
    allocating there: megatron's capture takes its own context class alone as a graph input."""
    cache = context.memory_buffer
    flat = pool.allocate(cache.numel() * cache.element_size())
    context.memory_buffer = flat.view(cache.dtype).view(cache.shape)
    del cache
    if flat.is_cuda:
        torch.cuda.empty_cache()  # megatron's own allocation, back to the driver


class KVHandoff:
    """The graphs of a graphed engine (`attach`, on the engine thread as it is built) and what
    it does beside megatron's suspend/resume, which keep the cache and the graphs (PERSIST):
    after `suspend()` the cache's memory goes back to the driver when no request holds any of
    it (the gate drains the requests in flight first; a request left in the cache keeps it
    resident and valid); before `resume()` it is mapped again at the same address
    (`VirtualMemoryPool`), so the graphs captured over it stay valid. `close` ends the graphs
    and the cache for good and gives the model back as it was built."""

    def __init__(self, model: Any, make_pool: Callable[[], KVPool]) -> None:
        self.model = model
        self._make_pool = make_pool
        self._pool: KVPool | None = None
        self._fields: dict[str, Any] = {}

    @property
    def pool(self) -> KVPool:
        """The cache's memory (made at first use: on the engine thread, on CUDA)."""
        if self._pool is None:
            self._pool = self._make_pool()
        return self._pool

    def attach(self) -> KVPool:
        """Make megatron's engine capture and replay the model's decoder block
        (`cuda_graph_impl` "local", `inference_cuda_graph_scope` block) on a model built
        without graphs (the trainer's), and return the pool for its cache. The block replays a
        graph only with megatron's inference mode active and an inference context (between
        resume and suspend): the trainer's forward runs it eagerly, and its layers get no graph
        manager. The manager is kept outside the module's children, so the model's parameters,
        state dict and checkpoints are those of the model without it."""
        config = self.model.config
        self._fields = {name: getattr(config, name) for name in _GRAPH_FIELDS}
        config.cuda_graph_impl = "local"
        config.inference_cuda_graph_scope = InferenceCudaGraphScope.block
        tracker = get_cuda_rng_tracker()
        # megatron's manager asks for an RNG tracker it could capture (its check reads this
        # flag alone in megatron 0.19); a decode step draws no random numbers inside the block
        # (dropout is off, sampling runs after it), so the trainer's tracker serves as it is.
        marked = tracker.is_inference_rng_tracker
        tracker.is_inference_rng_tracker = True
        try:
            manager = cuda_graphs.CudaGraphManager(config, need_backward=False)
        finally:
            tracker.is_inference_rng_tracker = marked
        object.__setattr__(self.model.decoder, "cudagraph_manager", manager)
        cuda_graphs.get_all_rng_states = _graph_safe_rng_states
        return self.pool

    def release(self, engine: Any) -> None:
        if engine.context.total_request_count == 0:
            self.pool.release()

    def restore(self, engine: Any) -> None:
        self.pool.restore()

    def close(self, engine: Any) -> None:
        cuda_graphs.delete_cuda_graphs()
        self.pool.free()
        self.model.decoder.__dict__.pop("cudagraph_manager", None)
        for name, value in self._fields.items():
            setattr(self.model.config, name, value)

    def memory_in_use(self, engine: Any) -> int:
        return self.pool.resident_bytes


_GRAPH_FIELDS = ("cuda_graph_impl", "inference_cuda_graph_scope")
_all_rng_states = cuda_graphs.get_all_rng_states


def _graph_safe_rng_states() -> dict[str, Any]:
    """What megatron's capture registers with each graph, of its RNG tracker's states: the
    generators alone. The trainer's tracker keeps its states as tensors (not graph safe), which
    megatron's capture cannot register (`get_state` of a tensor); a decode step draws from none
    of them (dropout is off), and the default generators megatron registers beside stay."""
    return {name: state for name, state in _all_rng_states().items() if isinstance(state, torch.Generator)}


def dynamic_engine(
    model: Any,
    inference: InferenceConfig,
    *,
    tokens: _Tokens,
    seed: int,
    device: torch.device,
    graphs: KVHandoff | None = None,
    sampler: Literal["race", "fused", "megatron"] = "race",
    attention: str = "adapter",
) -> DynamicInferenceEngine:
    """megatron's engine over `model`; called on the engine's own thread. With `graphs` its
    decode steps are captured into CUDA graphs, over a cache in the handoff's pool; its
    controller draws with `sampler` (`Serving`); its attention runs `attention`'s kernels
    (`rollout.attention`, `flash_adapter.pin`)."""
    flash_adapter.install()
    flash_adapter.pin(model, attention, one_split=flash_adapter.single_split(device))
    install_suspend()
    torch.cuda.set_device(device)  # this thread's: megatron allocates on the current device
    if graphs is None:
        context = DynamicInferenceContext(model.config, inference)
    else:
        pool = graphs.attach()  # megatron's manager moves this thread to a stream of its own:
        torch.cuda.synchronize()  # the weights as the caller's stream wrote them
        model.eval()  # the engine's constructor captures the graphs: a forward, in eval mode
        context = DynamicInferenceContext(model.config, inference)
        pool_cache(context, pool)
    controller = TextGenerationController(GPTInferenceWrapper(model, context), tokens)
    controller.sampling_rng.manual_seed(seed)
    if sampler != "megatron":  # else its own TorchSampling, as the controller built it
        kind = RaceSampling if sampler == "race" else FusedRaceSampling
        controller._sampling = kind(controller.sampling_rng)
    return DynamicInferenceEngine(controller, context)  # captures the graphs


def build_inference(
    model: Any,
    config: ModelConfig,
    spec: Input,
    *,
    stop_ids: Sequence[int],
    device: torch.device,
    serving: Serving = SERVING,
    copy: EngineCopy | ReplicaCopy | None = None,
    replica: int = 0,
) -> MegatronInference:
    """`MegatronInference` over a `DynamicInferenceEngine` serving `model`: the trainer's in
    place, or apart `copy.model`, which `copy` refreshes at each refit (from the trainer's in
    this process, `EngineCopy`; from the weights a Ray replica was sent, `ReplicaCopy`).
    `replica`: its index among the engine's replicas (each draws its own random numbers)."""
    inference_mode.install()  # apart, the trainer steps while the engine serves
    rollout = spec.sampling
    termination = termination_id(stop_ids)
    inference = inference_config(rollout, config, model.config.params_dtype, schedule=serving.schedule)
    tokens = _Tokens(termination, config.vocab_size)
    seed = spec.seed + 1 + 1000 * replica  # the torch engine's
    handoff = KVHandoff(model, lambda: VirtualMemoryPool(device)) if rollout.graphs else None
    return MegatronInference(
        lambda: dynamic_engine(
            model,
            inference,
            tokens=tokens,
            seed=seed,
            device=device,
            graphs=handoff,
            sampler=serving.sampler,
            attention=rollout.attention,
        ),
        handoff=handoff,
        sampling=functools.partial(
            sampling_params, temperature=rollout.temperature, top_p=rollout.top_p, termination=termination
        ),
        stop_token_ids=stop_ids,
        max_new_tokens=rollout.max_new_tokens,
        max_sequence_length=inference.max_sequence_length,
        lengths=length_draw(rollout, seed=spec.seed + 1000 * replica),
        memory_in_use=_kv_cache_in_use if handoff is None else handoff.memory_in_use,
        generator=lambda engine: engine.controller.sampling_rng,
        # megatron's inference attention asserts eval mode; the trainer's step sets train mode
        # again (colocated, the two never run at once).
        serving=model.eval,
        partial=rollout.partial,
        freeze=drop_pending_forward if rollout.partial else lambda engine: None,
        refresh_weights=None if copy is None else copy.refresh,
        fingerprint=(lambda: None) if copy is None else copy.fingerprint,
        weights_in=copy if isinstance(copy, ReplicaCopy) else None,
    )
