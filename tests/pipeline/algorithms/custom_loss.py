"""A user's own policy loss, named `tests.pipeline.algorithms.custom_loss:squared_advantage` in
the tests (`train.policy_loss: module:function`)."""

from __future__ import annotations

import torch

from pipeline.algorithms.config import LossConfig
from pipeline.algorithms.losses import LossInputs, LossOutputs


def squared_advantage(inputs: LossInputs, config: LossConfig) -> LossOutputs:
    """-A |A| x (logprobs - old): a policy gradient that weighs strong advantages more."""
    advantage = inputs.advantages.unsqueeze(-1)
    per_token = -(advantage * advantage.abs()) * (inputs.logprobs - inputs.old)
    zeros = torch.zeros_like(per_token)
    return LossOutputs(per_token=per_token, clipped=zeros, kl=zeros)


def infinite_constant(inputs: LossInputs, config: LossConfig) -> LossOutputs:
    """GRPO's token loss plus an infinite constant: a loss that is not finite while its gradient
    is (as a user's loss with a detached term could be)."""
    from pipeline.algorithms.losses import token_ratio

    out = token_ratio(inputs, config)
    return LossOutputs(per_token=out.per_token + torch.inf, clipped=out.clipped, kl=out.kl)
