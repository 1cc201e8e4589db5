"""How megatron's engine draws each token for the pipeline, and which logprob it reports.

`sampling_params` gives each request its parameters: the recipe's temperature and top-p, or
for a greedy request (an evaluation's, or `rollout.temperature: 0`) megatron's top-1 draw at
temperature 1. `RaceSampling` is the controller's sampler (`controller._sampling`, megatron's
`Sampling` interface) in place of megatron's `TorchSampling`:

- The draw is the torch engine's (`backends/torch/sampling.py`): the exponential race,
  argmax(log p - log E) with E ~ Exponential(1) per vocabulary entry, over the logits divided
  by each row's temperature, after a top-p cut (the smallest prefix by descending probability
  whose mass reaches top_p) where a row has one; a top-1 row takes the argmax. All rows at
  once, each with its own parameters.
- It never waits for the GPU. Each row's parameters are read from `context.gpu_view`, the
  GPU copy megatron publishes before each forward (its FlashInfer sampler reads the same), and
  the batch-level choices from the pinned host metadata. megatron's `TorchSampling` groups the
  rows by their parameters and moves each group's row indices to the GPU with a blocking copy
  (`torch.tensor(..., device=cuda)`), which waits for all the step's queued GPU work: under
  megatron's async schedule (`inference_config`) that wait would come before the next forward
  is launched, and the host's bookkeeping could not overlap it.
- Logprobs (`log_probs_kernel`, which megatron's `processed_logprobs` mode calls): the
  log-softmax of the logits divided by the row's temperature, before any top-p cut, and at
  temperature 1 for a greedy token (its parameters say 1), which is what the torch engine
  reports and the trainer recomputes. megatron's own processed logprobs are those of the
  filtered, renormalised nucleus (0 for a greedy token).

`FusedRaceSampling` (a bench variant, `serve.Serving`) draws a training batch's step (every row
sampled at one temperature, no top-p) with the torch engine's one-pass CUDA kernel instead
(`backends/torch/race.py`: the token and its logprob from one read of the logits, its noise
from Philox counters inside the kernel: the same distribution, other draws).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.inference.sampling.base import Sampling
from megatron.core.inference.sampling_params import SamplingParams
from torch import Tensor

from backends.torch import race as race_kernel


def sampling_params(
    greedy: bool, limit: int, *, temperature: float, top_p: float, termination: int
) -> SamplingParams:
    """One request's parameters: `limit` new tokens at most, each with its logprob. Greedy (an
    evaluation's, or temperature 0) is megatron's top-1 draw; else the recipe's temperature and
    top-p (megatron's top_p 0 is "off")."""
    greedy = greedy or temperature == 0
    return SamplingParams(
        temperature=1.0 if greedy else temperature,
        top_k=1 if greedy else 0,
        top_p=0.0 if greedy or top_p >= 1 else top_p,
        return_log_probs=True,
        skip_prompt_log_probs=True,
        num_tokens_to_generate=limit,
        termination_id=termination,
    )


class RaceSampling(Sampling):
    """megatron's sampler interface answered by the torch engine's draw, with no host sync
    (module docstring). Rows carry top_k 0 (sampled) or 1 (greedy): the only values
    `sampling_params` gives."""

    def __init__(self, rng: torch.Generator) -> None:
        self._rng = rng

    def sample_kernel(
        self,
        logits: Tensor,
        n: int,
        context: Any,
        *,
        no_top_k: bool,
        no_top_p: bool,
        gather_indices: Tensor | None = None,
        token_to_request_index: Tensor | None = None,
        output: Tensor | None = None,
        eager: bool = False,
        cache_key: Any = None,
    ) -> Tensor:
        # Speculative decoding (the only caller with a per-token request index) is not set up.
        assert token_to_request_index is None
        top_k = context.active_request_metadata["top_k"][:n]  # pinned host memory: no sync
        assert bool((top_k <= 1).all()), "RaceSampling draws top-1 or from the whole distribution"
        rows = logits[:n] if gather_indices is None else logits[gather_indices[:n]]
        if no_top_k or not bool((top_k == 1).all()):
            view = context.gpu_view
            tokens = race(
                rows.float() / view.temperature[:n, None], None if no_top_p else view.top_p[:n], self._rng
            )
            if not no_top_k:
                tokens = torch.where(view.top_k[:n] == 1, rows.argmax(dim=-1), tokens)
        else:  # every row greedy: nothing to draw
            tokens = rows.argmax(dim=-1)
        if output is None:
            return tokens
        return output.copy_(tokens)

    def log_probs_kernel(
        self, logits: Tensor, context: Any, *, token_to_request_index: Tensor | None = None
    ) -> Tensor:
        temperature = context.gpu_view.temperature
        if token_to_request_index is None:
            temperature = temperature[: logits.shape[0]]
        else:  # a row per prompt token (prefill, without materialize_only_last_token_logits)
            temperature = temperature[token_to_request_index.to(logits.device, non_blocking=True)]
        return torch.log_softmax(logits / temperature[:, None], dim=-1)


class FusedRaceSampling(RaceSampling):
    """`RaceSampling` whose draw of a step of sampled rows at one temperature with no top-p runs
    `race_draw` (module docstring) on CUDA. The kernel's logprobs are kept for the
    `log_probs_kernel` call that megatron makes next for the same rows (right after each draw,
    in either schedule), which returns them broadcast over the vocabulary: megatron reads the
    drawn token's entry alone (top-n logprobs are never asked for). Other steps, and a call that
    does not follow a fused draw of its rows, take `RaceSampling`'s ops."""

    def __init__(self, rng: torch.Generator) -> None:
        super().__init__(rng)
        self._drawn: Tensor | None = None  # the last fused draw's logprobs, until read

    def sample_kernel(self, logits: Tensor, n: int, context: Any, **options: Any) -> Tensor:
        """`RaceSampling.sample_kernel`'s arguments (megatron's interface)."""
        self._drawn = None
        temperature = context.active_request_metadata["temperature"][:n]  # pinned host memory
        fused = (
            n > 0
            and options["no_top_k"]
            and options["no_top_p"]
            and options.get("gather_indices") is None
            and options.get("token_to_request_index") is None
            and race_kernel.available(logits.device)
            and bool((temperature == temperature[0]).all())
        )
        if not fused:
            return super().sample_kernel(logits, n, context, **options)
        output = options.get("output")
        seed = torch.empty((), dtype=torch.long, device=logits.device).random_(generator=self._rng)
        noisy = torch.ones((), dtype=torch.float32, device=logits.device)
        inverse = context.gpu_view.temperature[:1].reciprocal()
        tokens, self._drawn = race_kernel.race_draw(logits[:n], inverse, seed, noisy)
        return tokens if output is None else output.copy_(tokens)

    def log_probs_kernel(
        self, logits: Tensor, context: Any, *, token_to_request_index: Tensor | None = None
    ) -> Tensor:
        drawn, self._drawn = self._drawn, None
        if drawn is None or token_to_request_index is not None or drawn.shape[0] != logits.shape[0]:
            return super().log_probs_kernel(logits, context, token_to_request_index=token_to_request_index)
        return drawn[:, None].expand_as(logits)


def race(scaled: Tensor, top_p: Tensor | None, generator: torch.Generator) -> Tensor:
    """One token per row of `scaled` (logits over temperature), drawn from its softmax, cut to
    its nucleus where the row's `top_p` (megatron's 0: no cut) says; each row's token is the
    torch engine's `draw` of that row from the same generator state."""
    noise = torch.empty_like(scaled).exponential_(generator=generator)
    whole = (scaled - noise.log()).argmax(dim=-1)  # log p differs from `scaled` by a row constant
    if top_p is None:
        return whole
    # As the torch engine draws a nucleus: the noise taken in the sorted order.
    sorted_probs, order = torch.softmax(scaled, dim=-1).sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs.masked_fill_(mass_before >= top_p[:, None], 0.0)
    nucleus = order.gather(-1, (sorted_probs / noise).argmax(dim=-1, keepdim=True)).squeeze(-1)
    return torch.where(top_p > 0, nucleus, whole)
