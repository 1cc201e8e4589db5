"""How megatron's engine draws for the pipeline (`backends/megatron/sampling.py`), on the CPU:
each request's parameters, `RaceSampling`'s draw (the torch engine's, each row with its own
parameters) and its logprobs (the torch engine's), also as megatron's own controller and context
call it. That it never waits for the GPU is a GPU test (tests/gpu/test_megatron_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron.core.inference.config import InferenceConfig  # noqa: E402
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext  # noqa: E402
from megatron.core.inference.text_generation_controllers.text_generation_controller import (  # noqa: E402
    TextGenerationController,
)

from backends.megatron import sampling  # noqa: E402
from backends.megatron.sampling import RaceSampling, sampling_params  # noqa: E402
from backends.torch.sampling import draw  # noqa: E402

VOCAB = 32


def _params(temperature: float, top_p: float, *, greedy: bool = False):
    return sampling_params(greedy, 5, temperature=temperature, top_p=top_p, termination=1)


def test_a_request_asks_for_its_limit_and_logprobs_and_greedy_ones_take_the_top_token() -> None:
    sampled = _params(0.7, 1.0)
    assert (sampled.temperature, sampled.top_k, sampled.top_p) == (0.7, 0, 0.0)
    assert (sampled.num_tokens_to_generate, sampled.termination_id) == (5, 1)
    assert sampled.return_log_probs and sampled.skip_prompt_log_probs
    assert (_params(0.7, 0.9).top_k, _params(0.7, 0.9).top_p) == (0, 0.9)
    for greedy in (_params(0.7, 0.9, greedy=True), _params(0.0, 0.9)):  # an evaluation's; temperature 0
        assert (greedy.temperature, greedy.top_k, greedy.top_p) == (1.0, 1, 0.0)


def _context(rows) -> SimpleNamespace:
    """megatron's context as the sampler reads it: each active row's parameters in pinned host
    metadata and in the GPU view megatron publishes before the forward (here both on the CPU).
    `rows`: one `SamplingParams` per row."""
    temperature = torch.tensor([p.temperature for p in rows], dtype=torch.float32)
    top_k = torch.tensor([p.top_k for p in rows], dtype=torch.int32)
    top_p = torch.tensor([p.top_p for p in rows], dtype=torch.float32)
    return SimpleNamespace(
        total_request_count=len(rows),
        paused_request_count=0,
        active_request_metadata={"temperature": temperature, "top_k": top_k, "top_p": top_p},
        gpu_view=SimpleNamespace(temperature=temperature, top_k=top_k, top_p=top_p),
    )


def _sample(logits: torch.Tensor, rows, seed: int = 1) -> torch.Tensor:
    """`RaceSampling.sample_kernel` with the flags megatron's controller passes."""
    sampler = RaceSampling(torch.Generator().manual_seed(seed))
    return sampler.sample_kernel(
        logits,
        len(rows),
        _context(rows),
        no_top_k=all(p.top_k == 0 for p in rows),
        no_top_p=all(p.top_p == 0 for p in rows),
    )


def _logits(rows: int = 64) -> torch.Tensor:
    return 3 * torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("temperature", "top_p"),
    [(1.0, 1.0), (0.7, 1.0), (0.7, 0.5), (1.3, 0.9), (0.0, 1.0)],
    ids=["plain", "temperature", "top-p", "temperature-top-p", "greedy"],
)
def test_the_draw_and_its_logprobs_are_the_torch_engines(temperature: float, top_p: float) -> None:
    """What the pipeline's token_mult_prob_error compares: from the same generator state the
    sampler draws the torch engine's tokens (temperature 0: the argmax), and reports their
    logprobs under the tempered distribution before the top-p cut (temperature 1 for a greedy
    token), the torch engine's."""
    logits = _logits()
    rows = [_params(temperature, top_p)] * 64
    drawn = _sample(logits, rows)
    tokens, logprobs = draw(logits, temperature, top_p, torch.Generator().manual_seed(1))
    assert torch.equal(drawn, tokens)
    sampler = RaceSampling(torch.Generator())
    picked = sampler.log_probs_kernel(logits, _context(rows)).gather(-1, drawn[:, None]).squeeze(-1)
    torch.testing.assert_close(picked, logprobs)


def test_each_row_draws_with_its_own_parameters() -> None:
    """A batch of sampled, tempered, top-p and greedy rows (an evaluation beside a training
    batch): each row's token is the one a batch of its parameters alone draws from the same
    generator state, and its logprob is under its own temperature."""
    logits = _logits()
    kinds = [_params(1.0, 1.0), _params(0.6, 1.0), _params(1.2, 0.8), _params(0.7, 1.0, greedy=True)]
    rows = [kinds[i % 4] for i in range(64)]
    mixed = _sample(logits, rows)
    for k, kind in enumerate(kinds):
        alone = _sample(logits, [kind] * 64)
        assert torch.equal(mixed[k::4], alone[k::4]), kind
    sampler = RaceSampling(torch.Generator())
    logprobs = sampler.log_probs_kernel(logits, _context(rows))
    for k, kind in enumerate(kinds):
        torch.testing.assert_close(logprobs[k::4], torch.log_softmax(logits[k::4] / kind.temperature, dim=-1))


def test_a_batch_of_greedy_rows_takes_the_argmax_and_draws_no_noise() -> None:
    generator = torch.Generator().manual_seed(1)
    state = generator.get_state()
    logits = _logits()
    tokens = RaceSampling(generator).sample_kernel(
        logits, 64, _context([_params(0.0, 1.0)] * 64), no_top_k=False, no_top_p=True
    )
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert torch.equal(generator.get_state(), state)


def test_megatrons_controller_and_context_call_it_for_the_tokens_and_their_logprobs() -> None:
    """megatron's own call sites, on the CPU: the controller's sampling step writes the drawn
    tokens into its token buffer (what its async schedule copies into the next forward's
    input), and the context's logprob step (`processed_logprobs`) gathers the sampler's
    logprobs at them."""
    logits = _logits(8)
    rows = [_params(0.7, 0.9)] * 6 + [_params(0.7, 0.9, greedy=True)] * 2
    context = _context(rows)
    context.config = InferenceConfig(
        materialize_only_last_token_logits=True, logprobs_mode="processed_logprobs"
    )
    context.paused_request_count = 0
    sampler = RaceSampling(torch.Generator().manual_seed(1))
    controller = SimpleNamespace(
        inference_wrapped_model=SimpleNamespace(inference_context=context),
        _all_logits_cuda=torch.cat([logits, torch.zeros(4, VOCAB)])[None],  # padded as graphed
        _sampled_tokens_cuda=torch.full((16,), -1),
        _sampling=sampler,
    )
    controller._active_requests_sampling_filter_flags = lambda count: (
        TextGenerationController._active_requests_sampling_filter_flags(controller, count)
    )
    TextGenerationController._dynamic_step_sample_logits(controller)
    tokens = controller._sampled_tokens_cuda[:8]
    assert torch.equal(tokens, _sample(logits, rows))
    assert torch.equal(tokens[6:], logits[6:].argmax(dim=-1))

    context._processed_log_probs = lambda *args, **kwargs: DynamicInferenceContext._processed_log_probs(
        context, *args, **kwargs
    )
    selected, _ = DynamicInferenceContext.calculate_log_probs_tensors(
        context, controller._all_logits_cuda[:, :8], tokens, only_last_token_logits=True, sampling=sampler
    )
    expected = torch.cat(
        [torch.log_softmax(logits[:6] / 0.7, dim=-1), torch.log_softmax(logits[6:], dim=-1)]
    ).gather(-1, tokens[:, None])
    torch.testing.assert_close(selected, expected.squeeze(-1))


def test_the_fused_draw_hands_its_logprobs_to_the_next_logprob_call_alone(monkeypatch) -> None:
    """`FusedRaceSampling` (its CUDA kernel replaced by a stand-in here): a step of sampled rows at
    one temperature is drawn by the kernel, and megatron's logprob step that follows reads the
    kernel's logprobs at the drawn tokens; a second logprob call, and a step with a greedy row,
    top-p rows or two temperatures, take `RaceSampling`'s ops."""
    calls = []

    def race_draw(logits, inverse, seed, noisy):
        calls.append((float(inverse), float(noisy)))
        return logits.argmax(dim=-1), -torch.arange(1.0, logits.shape[0] + 1)

    monkeypatch.setattr(sampling.race_kernel, "available", lambda device: True)
    monkeypatch.setattr(sampling.race_kernel, "race_draw", race_draw)
    logits = _logits(8)
    rows = [_params(0.5, 1.0)] * 8
    context = _context(rows)
    context.config = InferenceConfig(logprobs_mode="processed_logprobs")
    sampler = sampling.FusedRaceSampling(torch.Generator().manual_seed(1))
    out = torch.full((8,), -1)
    sampler.sample_kernel(logits, 8, context, no_top_k=True, no_top_p=True, output=out)
    assert calls == [(2.0, 1.0)] and torch.equal(out, logits.argmax(dim=-1))
    context._processed_log_probs = lambda *args, **kwargs: DynamicInferenceContext._processed_log_probs(
        context, *args, **kwargs
    )
    selected, _ = DynamicInferenceContext.calculate_log_probs_tensors(
        context, logits[None], out, only_last_token_logits=True, sampling=sampler
    )
    assert torch.equal(selected, -torch.arange(1.0, 9))
    again = sampler.log_probs_kernel(logits, context)  # nothing drawn since: computed
    torch.testing.assert_close(again, torch.log_softmax(logits / 0.5, dim=-1))
    greedy_row = [_params(0.5, 1.0)] * 7 + [_params(0.5, 1.0, greedy=True)]
    for mixed in (greedy_row, [_params(0.5, 0.9)] * 8, [_params(0.5, 1.0)] * 4 + [_params(0.7, 1.0)] * 4):
        flags = {"no_top_k": all(p.top_k == 0 for p in mixed), "no_top_p": all(p.top_p == 0 for p in mixed)}
        plain = RaceSampling(torch.Generator().set_state(sampler._rng.get_state()))
        expected = plain.sample_kernel(logits, 8, _context(mixed), **flags)
        assert torch.equal(sampler.sample_kernel(logits, 8, _context(mixed), **flags), expected)
    assert len(calls) == 1
