"""megatron's dynamic engine for a recipe (`rollout.engine: megatron`), on the CPU: its
schedule and sampler (tests/backends/test_megatron_sampling.py: what they draw), the KV cache's
size, the refusals, and the builder handing the trainer's own model to the engine (megatron's engine
itself needs CUDA: tests/gpu/test_megatron_gpu.py runs it)."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron.core.inference.config import AsyncScheduleMode, KVCacheManagementMode  # noqa: E402
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker  # noqa: E402
from megatron.core.transformer.enums import InferenceCudaGraphScope  # noqa: E402

import pipeline  # noqa: E402
from backends.megatron import serve  # noqa: E402
from backends.megatron.build import build_backend  # noqa: E402
from backends.megatron.inference import MegatronInference  # noqa: E402
from backends.megatron.model import compile_layers  # noqa: E402
from backends.megatron.sampling import RaceSampling  # noqa: E402
from backends.torch.kv_pool import PlainPool  # noqa: E402
from pipeline.contracts.errors import RecipeError  # noqa: E402
from pipeline.shell.backend_input import backend_input  # noqa: E402
from pipeline.testing import FakeDynamicEngine  # noqa: E402


def _bench(*overrides: str):
    return backend_input(
        pipeline.load_recipe(
            "recipes/bench-h200-colocated.yaml",
            ["train.backend=megatron", "rollout.engine=megatron", *overrides],
        )
    )


def test_the_kv_cache_holds_a_batchs_rows_at_twice_max_new_tokens() -> None:
    recipe = _bench()
    config = recipe.model.config
    assert config is not None
    per_token = 2 * 28 * 2 * 128 * 2  # keys and values, layers, kv heads, head_dim, bf16 bytes
    assert serve.kv_bytes_per_token(config, torch.bfloat16) == per_token
    inference = serve.inference_config(recipe.sampling, config, torch.bfloat16)
    # 32 prompts x 8 samples at L = 0, 1024 tokens each in 256-token blocks, and megatron's
    # reserved block: 7.0 GiB.
    assert inference.buffer_size_gb * 2**30 == (256 * 4 + 1) * 256 * per_token
    assert (inference.max_requests, inference.block_size_tokens) == (256, 256)
    assert inference.logprobs_mode == "processed_logprobs"
    assert inference.materialize_only_last_token_logits
    assert inference.async_sched_mode is AsyncScheduleMode.ASYNC
    legacy = serve.inference_config(
        recipe.sampling, config, torch.bfloat16, schedule=AsyncScheduleMode.LEGACY
    )
    assert legacy.async_sched_mode is AsyncScheduleMode.LEGACY
    set_by_hand = serve.inference_config(_bench("rollout.kv_cache_gb=2.5").sampling, config, torch.bfloat16)
    assert set_by_hand.buffer_size_gb == 2.5
    capped = serve.inference_config(_bench("rollout.max_rows=64").sampling, config, torch.bfloat16)
    assert capped.max_requests == 64 and capped.buffer_size_gb * 2**30 == (64 * 4 + 1) * 256 * per_token


def test_graphs_keep_the_cache_across_suspend_and_bound_each_row_to_its_room() -> None:
    """Graphed (`rollout.graphs`): megatron keeps its cache and graphs across suspend (the handoff
    gives the memory back), captures a decode graph per power of two rows and none for prefill,
    and a row is at most its room in the cache (a graphed step gathers that many keys a row).
    Without graphs (the default): recompute, no graphs, rows up to the model's positions."""
    recipe = _bench("rollout.graphs=true")
    graphed = serve.inference_config(recipe.sampling, recipe.model.config, torch.bfloat16)
    assert graphed.kv_cache_management_mode is KVCacheManagementMode.PERSIST
    assert (graphed.num_cuda_graphs, graphed.use_cuda_graphs_for_non_decode_steps) == (-1, False)
    assert graphed.max_sequence_length == 1024  # 2 x max_new_tokens 512, in 256-token blocks
    eager = serve.inference_config(_bench().sampling, recipe.model.config, torch.bfloat16)
    assert eager.kv_cache_management_mode is KVCacheManagementMode.RECOMPUTE
    assert eager.num_cuda_graphs is None
    assert eager.max_sequence_length == 32768  # the model's positions, not the cache's 262144
    assert eager.buffer_size_gb == graphed.buffer_size_gb


def test_a_kv_cache_too_small_for_one_row_is_refused() -> None:
    recipe = _bench("rollout.kv_cache_gb=0.01")  # 1.4 blocks of this model
    with pytest.raises(RecipeError) as raised:
        serve.inference_config(recipe.sampling, recipe.model.config, torch.bfloat16)
    assert str(raised.value) == (
        "rollout.kv_cache_gb: 0.01 holds 0 tokens of this model, not one prompt and "
        "rollout.max_new_tokens 512: raise it, or leave it at 0 (derived from the batch)"
    )


def _on_cpu(*overrides: str, **rollout):
    """The quickstart's backend input with train.backend megatron and rollout.engine megatron
    (and the `rollout` fields given), as the builder would see it on a GPU, here on the CPU: the
    recipe refuses the CPU for this engine, so its input is changed past that check."""
    recipe = pipeline.load_recipe(
        "recipes/quickstart.yaml", ["run.progress=false", "train.backend=megatron", *overrides]
    )
    spec = backend_input(recipe)
    sampling = msgspec.structs.replace(spec.sampling, engine="megatron", **rollout)
    return msgspec.structs.replace(spec, sampling=sampling)


async def test_the_builder_hands_the_trainers_own_model_to_megatrons_engine(monkeypatch) -> None:
    made = []

    def engine_on_cpu(model, inference, *, tokens, seed, device, graphs, sampler, attention):
        made.append((model, inference, tokens, seed, sampler, attention))
        return FakeDynamicEngine(length=5, vocab=16)

    monkeypatch.setattr(serve, "dynamic_engine", engine_on_cpu)
    on_cpu = _on_cpu("rollout.temperature=0.8", attention="flash-attn-4")
    engine, trainer = build_backend(on_cpu, vocab_size=16, stop_ids=[1])
    try:
        assert isinstance(engine, MegatronInference)
        assert engine.blocks_training and engine.wake_carries_weights and engine.fingerprint() is None
        ((model, inference, tokens, seed, sampler, attention),) = made
        assert attention == "flash-attn-4"  # rollout.attention, as the engine is built with it
        assert model is trainer.model  # served in place: no copy to refresh
        assert (tokens.eod, seed, inference.max_requests) == (1, 1, 32 * 8 * 2)
        assert (inference.async_sched_mode, sampler) == (AsyncScheduleMode.ASYNC, "race")
        assert len(await engine.generate([3, 4, 5], 2)) == 2
        await engine.generate([3], 1, greedy=True)
        sampling = engine.engine.sampling  # as the fake engine received it
        asked = [(p.temperature, p.top_k, p.num_tokens_to_generate, p.termination_id) for p in sampling]
        assert asked == [(0.8, 0, 5, 1), (0.8, 0, 5, 1), (1.0, 1, 5, 1)]
    finally:
        engine.close()
        trainer.close()


def test_each_replica_draws_from_a_seed_of_its_own(monkeypatch) -> None:
    """Colocated data-parallel ranks on Ray each hold a replica (`replica`): seeded as the
    torch engine's replicas, so no two draw the same random numbers."""
    seeds = []

    def engine_on_cpu(model, inference, *, tokens, seed, device, graphs, sampler, attention):
        seeds.append(seed)
        return FakeDynamicEngine(length=5, vocab=16)

    monkeypatch.setattr(serve, "dynamic_engine", engine_on_cpu)
    engine, trainer = build_backend(_on_cpu(), vocab_size=16, stop_ids=[1], replica=2)
    engine.close()
    trainer.close()
    assert seeds == [1 + 1000 * 2]  # recipe seed 0


def test_a_tokenizer_with_several_stop_tokens_is_refused() -> None:
    with pytest.raises(RecipeError) as raised:
        build_backend(_on_cpu(), vocab_size=16, stop_ids=[1, 2])
    assert str(raised.value) == (
        "rollout.engine: megatron ends a request at one token id (megatron's termination_id), but the "
        "model's tokenizer has 2 stop tokens (1, 2); use rollout.engine: torch"
    )


def test_a_compiled_layer_runs_eagerly_when_megatrons_engine_calls_it() -> None:
    """Training calls a layer with no inference context (compiled); megatron's engine with one,
    whose paged-cache bookkeeping compiled code would trace: that call runs eagerly."""

    class Layer(torch.nn.Module):
        def forward(self, hidden_states, inference_context=None):
            return torch.compiler.is_compiling()

    model = SimpleNamespace(decoder=SimpleNamespace(layers=[Layer(), Layer()]))
    compile_layers(model)
    for layer in model.decoder.layers:
        assert layer._compiled_call_impl is not None
        assert layer(hidden_states=None, inference_context=object()) is False


def test_suspend_empties_torchs_cache_without_collecting_garbage_when_no_graph_was_captured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """megatron's `delete_cuda_graphs` runs `gc.collect()` at every `suspend()` (146-354 ms a
    stand-down on the H200); with no graph recorded only the cache is emptied, and an engine
    with graphs still has them deleted by megatron's own function."""
    from megatron.core.inference.engines import dynamic_engine
    from megatron.core.transformer import cuda_graphs

    calls: list[str] = []
    monkeypatch.setattr(dynamic_engine, "delete_cuda_graphs", dynamic_engine.delete_cuda_graphs)
    monkeypatch.setattr(cuda_graphs.gc, "collect", lambda *a: calls.append("gc.collect") or 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    serve.install_suspend()
    dynamic_engine.delete_cuda_graphs()  # as `suspend()` calls it
    assert calls == ["empty_cache"]

    record = cuda_graphs._CudagraphGlobalRecord
    monkeypatch.setattr(record, "cudagraph_inference_record", [("a runner",)])
    monkeypatch.setattr(cuda_graphs, "delete_cuda_graphs", lambda: calls.append("megatron's"))
    dynamic_engine.delete_cuda_graphs()
    assert calls == ["empty_cache", "megatron's"]


class _Context:
    def __init__(self, requests: int) -> None:
        self.total_request_count = requests


def test_a_stand_down_gives_the_cache_back_only_when_no_request_holds_any_of_it() -> None:
    """After megatron's suspend (which keeps the cache: PERSIST), the handoff unmaps its memory
    when the cache holds no request; a request left in it (not drained) keeps it resident, so
    it resumes over valid keys. The wake maps the memory again."""
    handoff = serve.KVHandoff(model=None, make_pool=lambda: PlainPool(torch.device("cpu")))
    handoff.pool.allocate(4096)
    handoff.release(SimpleNamespace(context=_Context(requests=1)))
    assert handoff.memory_in_use(None) == 4096
    handoff.release(SimpleNamespace(context=_Context(requests=0)))
    assert handoff.memory_in_use(None) == 0
    handoff.restore(None)
    assert handoff.memory_in_use(None) == 4096


def test_graphs_attach_to_the_decoder_block_and_close_gives_the_model_back_as_built(monkeypatch) -> None:
    """The trainer's model gets megatron's block-scope inference graphs while served: a manager
    on its decoder block that is no child module (parameters, state dict, checkpoints unchanged)
    and no layer manager (the training forward stays eager); its RNG tracker passes megatron's
    check only while the manager is made. Close undoes it all."""
    monkeypatch.setattr(serve, "dynamic_engine", lambda *args, **kwargs: FakeDynamicEngine())
    engine, trainer = build_backend(_on_cpu(), vocab_size=16, stop_ids=[1])
    engine.close()
    model = trainer.model
    built = {name: getattr(model.config, name) for name in serve._GRAPH_FIELDS}
    keys = list(model.state_dict())
    made = []

    class Manager:
        def __init__(self, config, *, need_backward):
            made.append((config.cuda_graph_impl, config.inference_cuda_graph_scope, need_backward))
            made.append(get_cuda_rng_tracker().is_inference_rng_tracker)

    monkeypatch.setattr(serve.cuda_graphs, "CudaGraphManager", Manager)
    monkeypatch.setattr(serve.cuda_graphs, "delete_cuda_graphs", lambda: made.append("deleted"))
    monkeypatch.setattr(serve.cuda_graphs, "get_all_rng_states", serve.cuda_graphs.get_all_rng_states)
    tracker = get_cuda_rng_tracker()
    monkeypatch.setattr(tracker, "is_inference_rng_tracker", False)  # the trainer's, on CUDA
    handoff = serve.KVHandoff(model, lambda: PlainPool(torch.device("cpu")))
    try:
        assert isinstance(handoff.attach(), PlainPool)
        assert made == [("local", InferenceCudaGraphScope.block, False), True]
        assert isinstance(model.decoder.cudagraph_manager, Manager)
        assert not tracker.is_inference_rng_tracker
        assert serve.cuda_graphs.get_all_rng_states is serve._graph_safe_rng_states  # what captures register
        assert list(model.state_dict()) == keys
        assert not any(isinstance(m, Manager) for m in model.modules())
        assert not any(hasattr(layer, "cudagraph_manager") for layer in model.decoder.layers)
        handoff.pool.allocate(64)
    finally:
        handoff.close(None)
        trainer.close()
    assert made[-1] == "deleted" and handoff.memory_in_use(None) == 0
    assert not hasattr(model.decoder, "cudagraph_manager")
    assert {name: getattr(model.config, name) for name in serve._GRAPH_FIELDS} == built
    assert built["cuda_graph_impl"] == "none"


def test_the_contexts_kv_cache_moves_into_the_pool_with_its_shape_and_dtype() -> None:
    context = SimpleNamespace(memory_buffer=torch.empty(2, 3, 4, 256, 2, 8, dtype=torch.bfloat16))
    pool = PlainPool(torch.device("cpu"))
    serve.pool_cache(context, pool)
    cache = context.memory_buffer
    assert (cache.shape, cache.dtype) == ((2, 3, 4, 256, 2, 8), torch.bfloat16)
    assert cache.data_ptr() == pool.restore().data_ptr()
    assert pool.resident_bytes == cache.numel() * 2


def test_a_capture_registers_the_trackers_generators_and_not_its_tensor_states(monkeypatch) -> None:
    """The trainer's RNG tracker keeps its states as tensors (not graph safe), which megatron's
    capture cannot register; generators (a graph-safe tracker's) are registered as before."""
    generator = torch.Generator()
    monkeypatch.setattr(
        serve, "_all_rng_states", lambda: {"model-parallel-rng": torch.zeros(8), "graph-safe": generator}
    )
    assert serve._graph_safe_rng_states() == {"graph-safe": generator}


@pytest.mark.parametrize("sampler", ["race", "megatron"])
def test_megatrons_controller_draws_with_the_race_sampler(monkeypatch, sampler: str) -> None:
    """The engine as `dynamic_engine` wires it (megatron's classes, which need CUDA, replaced by
    stand-ins): its controller draws with `RaceSampling` over the controller's seeded RNG, or
    keeps megatron's own sampler where the bench asks for it."""
    megatrons = object()

    class Controller:
        def __init__(self, wrapped, tokens) -> None:
            self.sampling_rng = torch.Generator()
            self._sampling = megatrons

    monkeypatch.setattr(serve, "DynamicInferenceContext", lambda config, inference: None)
    monkeypatch.setattr(serve, "GPTInferenceWrapper", lambda model, context: None)
    monkeypatch.setattr(serve, "TextGenerationController", Controller)
    monkeypatch.setattr(serve, "DynamicInferenceEngine", lambda controller, context: controller)
    monkeypatch.setattr(serve.torch.cuda, "set_device", lambda device: None)
    model = SimpleNamespace(config=None, modules=lambda: [])  # no attention layers to pin
    tokens = serve._Tokens(1, 32)
    controller = serve.dynamic_engine(
        model, None, tokens=tokens, seed=7, device=torch.device("cpu"), sampler=sampler
    )
    assert torch.equal(controller.sampling_rng.get_state(), torch.Generator().manual_seed(7).get_state())
    if sampler == "megatron":
        assert controller._sampling is megatrons
        return
    assert isinstance(controller._sampling, RaceSampling)
    assert controller._sampling._rng is controller.sampling_rng
