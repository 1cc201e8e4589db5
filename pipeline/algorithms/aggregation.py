"""Loss aggregations: how a minibatch's per-token losses add up to the one loss it steps on.

Each gives a weight per response token, so that the minibatch's loss is `sum(per_token *
weight)` over all its micro-batches. Weights are computed from counts over the whole minibatch
(every micro-batch), so splitting it into micro-batches, or over data-parallel ranks whose
counts are summed first, leaves the update unchanged. Registered for `train.loss_aggregation`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeline.algorithms.registry import Registry


@dataclass(frozen=True)
class Counts:
    """A minibatch's totals: response tokens, sequences, and the longest response allowed
    (`Algorithm.max_response_tokens`)."""

    tokens: float
    sequences: float
    max_response_tokens: int


# (mask [N, R] of one micro-batch, the minibatch's counts) -> weight [N, R]
AggregationFn = Callable[[torch.Tensor, Counts], torch.Tensor]
AGGREGATIONS: Registry[AggregationFn] = Registry("loss aggregation", "train.loss_aggregation")


@AGGREGATIONS.register("token_mean")
def token_mean(mask: torch.Tensor, counts: Counts) -> torch.Tensor:
    """Every token of the minibatch weighs the same (DAPO; long responses weigh more)."""
    return mask / max(counts.tokens, 1.0)


@AGGREGATIONS.register("sequence_mean")
def sequence_mean(mask: torch.Tensor, counts: Counts) -> torch.Tensor:
    """The mean over sequences of each sequence's token mean (the GRPO paper's)."""
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return mask / (lengths * max(counts.sequences, 1.0))


@AGGREGATIONS.register("token_sum")
def token_sum(mask: torch.Tensor, counts: Counts) -> torch.Tensor:
    """The token sum over a constant, sequences x `max_response_tokens` (Dr. GRPO: no length bias)."""
    return mask / (max(counts.sequences, 1.0) * counts.max_response_tokens)
