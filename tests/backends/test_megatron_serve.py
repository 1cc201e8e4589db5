"""megatron's dynamic engine for a recipe (`rollout.engine: megatron`), on the CPU: what each
request asks megatron's sampler for and the logprobs that gives, the KV cache's size, the
refusals, and the builder handing the trainer's own model to the engine (megatron's engine
itself needs CUDA: tests/gpu/test_megatron_gpu.py runs it)."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron.core.inference.config import KVCacheManagementMode  # noqa: E402
from megatron.core.inference.sampling.torch_sampling import TorchSampling  # noqa: E402

import pipeline  # noqa: E402
from backends.megatron import serve  # noqa: E402
from backends.megatron.build import build_backend  # noqa: E402
from backends.megatron.inference import MegatronInference  # noqa: E402
from backends.megatron.model import compile_layers  # noqa: E402
from backends.torch.sampling import draw  # noqa: E402
from pipeline.contracts.errors import RecipeError  # noqa: E402
from pipeline.shell.backend_input import backend_input  # noqa: E402
from pipeline.testing import FakeDynamicEngine  # noqa: E402


def _processed_logprobs(logits: torch.Tensor, params) -> torch.Tensor:
    """megatron's `log_probs_kernel` (logprobs_mode "processed_logprobs") for rows of one request's
    parameters, over a stand-in for the context's per-request metadata."""
    rows = logits.shape[0]
    context = SimpleNamespace(
        total_request_count=rows,
        paused_request_count=0,
        active_request_metadata={
            "temperature": torch.full((rows,), params.temperature),
            "top_k": torch.full((rows,), params.top_k),
            "top_p": torch.full((rows,), params.top_p),
        },
    )
    return TorchSampling(torch.Generator(), logits.shape[1]).log_probs_kernel(logits, context)


def test_the_engines_logprobs_are_the_torch_engines_at_the_recipes_temperature() -> None:
    """What the pipeline's token_mult_prob_error compares: megatron's processed logprobs of the
    tokens are the torch engine's (the tempered distribution's); its raw ones are not."""
    logits = 3 * torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    params = serve.sampling_params(False, 5, temperature=0.7, termination=1)
    tokens, ours = draw(logits, 0.7, 1.0, torch.Generator().manual_seed(1))
    picked = _processed_logprobs(logits, params).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(picked, ours)
    raw = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    assert not torch.allclose(raw, ours, atol=1e-3)


def test_a_request_asks_for_its_limit_and_logprobs_and_greedy_ones_take_the_top_token() -> None:
    sampled = serve.sampling_params(False, 7, temperature=0.7, termination=1)
    assert (sampled.temperature, sampled.top_k, sampled.top_p) == (0.7, 0, 0.0)
    assert (sampled.num_tokens_to_generate, sampled.termination_id) == (7, 1)
    assert sampled.return_log_probs and sampled.skip_prompt_log_probs
    greedy = serve.sampling_params(True, 7, temperature=0.7, termination=1)
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    drawn = TorchSampling.sample_from_logits(
        logits, greedy.temperature, greedy.top_k, greedy.top_p, generator=torch.Generator()
    )
    assert torch.equal(drawn, logits.argmax(dim=-1))


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
    assert inference.max_sequence_length == 32768  # the model's positions, not the cache's 262144
    assert inference.kv_cache_management_mode is KVCacheManagementMode.RECOMPUTE
    assert inference.logprobs_mode == "processed_logprobs"
    assert inference.materialize_only_last_token_logits
    set_by_hand = serve.inference_config(_bench("rollout.kv_cache_gb=2.5").sampling, config, torch.bfloat16)
    assert set_by_hand.buffer_size_gb == 2.5
    capped = serve.inference_config(_bench("rollout.max_rows=64").sampling, config, torch.bfloat16)
    assert capped.max_requests == 64 and capped.buffer_size_gb * 2**30 == (64 * 4 + 1) * 256 * per_token


def test_a_kv_cache_too_small_for_one_row_is_refused() -> None:
    recipe = _bench("rollout.kv_cache_gb=0.01")  # 1.4 blocks of this model
    with pytest.raises(RecipeError) as raised:
        serve.inference_config(recipe.sampling, recipe.model.config, torch.bfloat16)
    assert str(raised.value) == (
        "rollout.kv_cache_gb: 0.01 holds 0 tokens of this model, not one prompt and "
        "rollout.max_new_tokens 512: raise it, or leave it at 0 (derived from the batch)"
    )


def _on_cpu(*overrides: str):
    """The quickstart's backend input with train.backend megatron and rollout.engine megatron,
    as the builder would see it on a GPU, here on the CPU: the recipe refuses the CPU for this
    engine, so its input is changed past that check."""
    recipe = pipeline.load_recipe(
        "recipes/quickstart.yaml", ["run.progress=false", "train.backend=megatron", *overrides]
    )
    spec = backend_input(recipe)
    return msgspec.structs.replace(spec, sampling=msgspec.structs.replace(spec.sampling, engine="megatron"))


async def test_the_builder_hands_the_trainers_own_model_to_megatrons_engine(monkeypatch) -> None:
    made = []

    def engine_on_cpu(model, inference, *, tokens, seed, device):
        made.append((model, inference, tokens, seed))
        return FakeDynamicEngine(length=5, vocab=16)

    monkeypatch.setattr(serve, "dynamic_engine", engine_on_cpu)
    engine, trainer = build_backend(_on_cpu("rollout.temperature=0.8"), vocab_size=16, stop_ids=[1])
    try:
        assert isinstance(engine, MegatronInference)
        assert engine.blocks_training and engine.wake_carries_weights and engine.fingerprint() is None
        ((model, inference, tokens, seed),) = made
        assert model is trainer.model  # served in place: no copy to refresh
        assert (tokens.eod, seed, inference.max_requests) == (1, 1, 32 * 8 * 2)
        assert len(await engine.generate([3, 4, 5], 2)) == 2
        await engine.generate([3], 1, greedy=True)
        sampling = engine.engine.sampling  # as the fake engine received it
        asked = [(p.temperature, p.top_k, p.num_tokens_to_generate, p.termination_id) for p in sampling]
        assert asked == [(0.8, 0, 5, 1), (0.8, 0, 5, 1), (1.0, 1, 5, 1)]
    finally:
        engine.close()
        trainer.close()


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
