"""The mismatch metrics' formulas, and masking that keeps them finite."""

from __future__ import annotations

import math

import torch

from pipeline.algorithms.losses import mismatch_metrics


def test_mismatch_metrics_formulas_over_masked_tokens() -> None:
    train = torch.tensor([[-1.0, -2.0, -500.0]])
    gen = torch.tensor([[-1.5, -2.0, 0.0]])  # the last position is outside the mask
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    metrics = mismatch_metrics(train, gen, mask)
    assert math.isclose(metrics["train/token_mult_prob_error"], (math.exp(0.5) + 1.0) / 2, rel_tol=1e-6)
    assert math.isclose(metrics["train/gen_kl_error"], (math.exp(0.5) - 1.0 - 0.5) / 2, rel_tol=1e-6)


def test_a_row_with_no_trained_token_weighs_nothing_in_every_aggregation() -> None:
    """A sample whose loss mask is all zeros (all its tokens context) adds nothing, not NaN."""
    from pipeline.algorithms.aggregation import AGGREGATIONS, Counts

    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    counts = Counts(tokens=2.0, sequences=2.0, max_response_tokens=2)
    for name in ("token_mean", "sequence_mean", "token_sum"):
        weights = AGGREGATIONS.get(name)(mask, counts)
        assert torch.isfinite(weights).all() and weights[1].tolist() == [0.0, 0.0], name
