"""The GRPO token loss and the engine/trainer mismatch metrics (formulas of docs/DESIGN.md, "Training")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LossConfig:
    clip_low: float
    clip_high: float
    kl_coef: float
    is_correction: str  # "none" | "tis" | "icepop"
    is_cap: float

    @classmethod
    def of(cls, train: Any) -> LossConfig:
        """The loss options of a recipe's `train` section (every backend's)."""
        return cls(
            clip_low=train.clip_low,
            clip_high=train.clip_high,
            kl_coef=train.kl_coef,
            is_correction=train.is_correction,
            is_cap=train.is_cap,
        )


def grpo_token_loss(
    logprobs: torch.Tensor,
    *,
    old: torch.Tensor,
    gen: torch.Tensor,
    reference: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
) -> dict[str, torch.Tensor]:
    """Summed (not averaged) clipped-surrogate loss over masked tokens, plus diagnostics.

    ratio = exp(logprobs - old) against the trainer's pre-step logprobs; the off-policy weight
    exp(old - gen) against the engine's behaviour logprobs is truncated (`tis`) or masked
    outside [1/cap, cap] (`icepop`); k3 KL to the reference is added when `kl_coef` > 0.
    """
    advantage = advantages.unsqueeze(-1)
    ratio = torch.exp(logprobs - old)
    clipped_ratio = ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    per_token = -torch.minimum(ratio * advantage, clipped_ratio * advantage)
    if config.is_correction != "none":
        weight = torch.exp(old - gen)
        if config.is_correction == "tis":
            weight = weight.clamp(max=config.is_cap)
        else:
            inside = (weight >= 1.0 / config.is_cap) & (weight <= config.is_cap)
            weight = torch.where(inside, weight, torch.zeros_like(weight))
        per_token = per_token * weight.detach()
    kl_sum = torch.zeros((), device=logprobs.device)
    if reference is not None and config.kl_coef > 0:
        delta = reference - logprobs
        k3 = torch.exp(delta) - delta - 1.0
        per_token = per_token + config.kl_coef * k3
        kl_sum = (k3.detach() * mask).sum()
    clipped = ((ratio.detach() != clipped_ratio.detach()).float() * mask).sum()
    return {"loss_sum": (per_token * mask).sum(), "clipped": clipped, "kl_sum": kl_sum}


@torch.no_grad()
def mismatch_metrics(train: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """`train/token_mult_prob_error` = mean exp(|gen - train|); `train/gen_kl_error` = mean k3."""
    tokens = mask.sum().clamp(min=1.0)
    # Masked before exp: positions outside the mask may hold anything (a prompt logprob far
    # below -88 against a 0 placeholder would overflow to inf, and inf * 0 is NaN).
    r = (train - gen) * mask
    return {
        "train/token_mult_prob_error": float((torch.exp(r.abs()) * mask).sum() / tokens),
        "train/gen_kl_error": float(((torch.exp(r) - 1.0 - r) * mask).sum() / tokens),
    }
