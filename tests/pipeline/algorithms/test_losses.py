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
