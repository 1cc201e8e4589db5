"""The trainers' typed inputs (`pipeline.contracts.backend_input`) for tests that build a
trainer by hand: the recipe's defaults where a test does not say."""

from __future__ import annotations

from typing import Any

from pipeline.contracts.backend_input import Batching, Optimizer


def optimizer(**given: Any) -> Optimizer:
    """AdamW at lr 1e-3, constant, 10 steps, clip 1.0, unless `given` says."""
    fields: dict[str, Any] = {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "weight_decay": 0.0,
        "warmup_steps": 0,
        "schedule": "constant",
        "min_lr_ratio": 0.1,
        "grad_clip": 1.0,
        "total_steps": 10,
    }
    return Optimizer(**(fields | given))


def batching(
    micro_batch_samples: int = 256, micro_batch_tokens: int = 0, updates_per_step: int = 1
) -> Batching:
    return Batching(
        micro_batch_samples=micro_batch_samples,
        micro_batch_tokens=micro_batch_tokens,
        updates_per_step=updates_per_step,
    )
