"""Policy losses: the clipped surrogate at token level (GRPO, DAPO) or sequence level (GSPO),
with the off-policy importance-sampling correction and the reference KL beside either, and the
engine/trainer mismatch metrics (formulas of docs/DESIGN.md, "Training").

A loss is `(LossInputs, LossConfig) -> LossOutputs`, registered for `train.policy_loss`; a
user's own is `module:function` with that signature. It returns per-token losses; the update
loop weighs them by the aggregation's weights, so a loss never decides how tokens add up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeline.algorithms.config import LossConfig
from pipeline.algorithms.registry import Registry


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch, float32 [N, R] (response tokens; 0 past each response) unless said.

    `logprobs` carry the gradient; `old` are the trainer's pre-step logprobs, `gen` the
    engine's behaviour logprobs, `reference` the reference model's (None without a KL term);
    `advantages` is [N]; `mask` marks real tokens."""

    logprobs: torch.Tensor
    old: torch.Tensor
    gen: torch.Tensor
    reference: torch.Tensor | None
    advantages: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class LossOutputs:
    """`per_token` [N, R]: each token's loss (the loop weighs and sums it); `clipped` [N, R]:
    1.0 where the ratio was clipped; `kl` [N, R]: the k3 reference KL (zeros without one)."""

    per_token: torch.Tensor
    clipped: torch.Tensor
    kl: torch.Tensor


LossFn = Callable[[LossInputs, LossConfig], LossOutputs]
LOSSES: Registry[LossFn] = Registry("policy loss", "train.policy_loss")


@LOSSES.register("token")
def token_ratio(inputs: LossInputs, config: LossConfig) -> LossOutputs:
    """GRPO's clipped surrogate on each token's ratio exp(logprobs - old)."""
    ratio = torch.exp(inputs.logprobs - inputs.old)
    return _surrogate(ratio, inputs, config)


@LOSSES.register("sequence")
def sequence_ratio(inputs: LossInputs, config: LossConfig) -> LossOutputs:
    """GSPO: one ratio a sequence, the geometric mean of its token ratios (exp of the mean log
    ratio over its tokens), clipped per sequence; every token of a sequence carries its loss,
    so `sequence_mean` aggregation gives the sequence-level objective."""
    lengths = inputs.mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    log_ratio = ((inputs.logprobs - inputs.old) * inputs.mask).sum(dim=1, keepdim=True) / lengths
    ratio = torch.exp(log_ratio).expand_as(inputs.logprobs)
    return _surrogate(ratio, inputs, config)


def _surrogate(ratio: torch.Tensor, inputs: LossInputs, config: LossConfig) -> LossOutputs:
    """-min(ratio A, clip(ratio) A), times the off-policy weight exp(old - gen), truncated at
    `is_cap` (`tis`) or zero outside [1/cap, cap] (`icepop`), plus `kl_coef` x k3 KL."""
    advantage = inputs.advantages.unsqueeze(-1)
    clipped_ratio = ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    per_token = -torch.minimum(ratio * advantage, clipped_ratio * advantage)
    if config.is_correction != "none":
        weight = torch.exp(inputs.old - inputs.gen)
        if config.is_correction == "tis":
            weight = weight.clamp(max=config.is_cap)
        else:
            inside = (weight >= 1.0 / config.is_cap) & (weight <= config.is_cap)
            weight = torch.where(inside, weight, torch.zeros_like(weight))
        per_token = per_token * weight.detach()
    kl = torch.zeros_like(per_token)
    if inputs.reference is not None and config.kl_coef > 0:
        delta = inputs.reference - inputs.logprobs
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + config.kl_coef * kl
    clipped = (ratio.detach() != clipped_ratio.detach()).to(per_token.dtype)
    return LossOutputs(per_token=per_token, clipped=clipped, kl=kl.detach())


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
