"""The sampler's argument checks, its eager next-token draw, and the Completion records.

The draw picks argmax(p / E) with E ~ Exponential(1) per vocabulary entry, which selects token
i with probability p_i (the exponential race; equivalent to the Gumbel-max trick). Unlike
`torch.multinomial` it has a fixed shape and no host sync, so a CUDA graph can capture it; the
decode step draws the same way (as argmax(log p - log E): the same draw, rounded differently).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from pipeline.contracts.messages import Completion


def check_arguments(
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    *,
    max_positions: int | None = None,
    limits: Sequence[int] | None = None,
) -> None:
    """Raise ValueError for bad sampling arguments; `max_positions` bounds prompt + new tokens
    (a model with learned position embeddings has no row past its table); `limits` bound each
    row's new tokens, each in 1..max_new_tokens."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if limits is not None and not all(1 <= n <= max_new_tokens for n in limits):
        raise ValueError(f"limits must be in 1..max_new_tokens {max_new_tokens}, got {list(limits)}")
    check_prompts(prompts, max_new_tokens, max_positions=max_positions, limits=limits)


def check_prompts(
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    max_positions: int | None,
    limits: Sequence[int] | None = None,
) -> None:
    """`check_arguments`'s checks of the prompts alone (the other arguments known good);
    `limits`: each row's own bound on new tokens (`generate`'s), in place of `max_new_tokens`."""
    if prompts and min(len(p) for p in prompts) == 0:
        raise ValueError("prompts must be non-empty")
    if max_positions is not None and prompts:
        bounds = limits if limits is not None else [max_new_tokens] * len(prompts)
        length, new = max(((len(p), n) for p, n in zip(prompts, bounds, strict=True)), key=sum)
        if length + new > max_positions:
            raise ValueError(
                f"a prompt of {length} tokens + max_new_tokens {new} exceeds "
                f"model.config.max_position_embeddings {max_positions} (learned position embeddings)"
            )


def draw(
    logits: Tensor, temperature: float, top_p: float, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Next token [B] and its logprob [B] under logits / temperature (before top-p truncation).

    Temperature 0 is greedy, with the temperature-1 logprob.
    """
    if temperature == 0:
        scaled = logits
        token = logits.argmax(dim=-1)
    else:
        scaled = logits / temperature if temperature != 1 else logits
        probs = torch.softmax(scaled, dim=-1)
        if top_p < 1:
            # Keep the smallest prefix (by descending probability) whose mass reaches top_p.
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            sorted_probs.masked_fill_(mass_before >= top_p, 0.0)
            noise = torch.empty_like(sorted_probs).exponential_(generator=generator)
            token = order.gather(-1, (sorted_probs / noise).argmax(dim=-1, keepdim=True)).squeeze(-1)
        else:
            noise = torch.empty_like(probs).exponential_(generator=generator)
            token = (probs / noise).argmax(dim=-1)
    picked = scaled.gather(-1, token.unsqueeze(-1)).squeeze(-1)
    return token, picked - torch.logsumexp(scaled, dim=-1)


def completions(
    generated: list[int],
    tokens: list[list[int]],
    logprobs: list[list[float]],
    stop_token_ids: Sequence[int],
    frozen: list[bool] | None = None,
) -> list[Completion]:
    """One Completion per row: its first `generated[row]` tokens and their logprobs; rows
    `frozen` (cut by a freeze before they finished) get finish_reason "frozen"."""
    stop_ids = set(stop_token_ids)
    results = []
    for row, (n, toks, lps) in enumerate(zip(generated, tokens, logprobs, strict=True)):
        reason: Literal["stop", "length", "frozen"] = "stop" if toks[n - 1] in stop_ids else "length"
        if frozen is not None and frozen[row]:
            reason = "frozen"
        if n < len(toks):
            toks, lps = toks[:n], lps[:n]
        results.append(Completion(tokens=tuple(toks), logprobs=tuple(lps), finish_reason=reason))
    return results
