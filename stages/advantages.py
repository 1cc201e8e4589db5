"""GRPO advantages: reward minus the leave-one-out group mean, over the group std when > 0."""

from __future__ import annotations

from collections.abc import Sequence
from statistics import pstdev


def leave_one_out(rewards: Sequence[float]) -> list[float]:
    """Advantages for one group; a group of fewer than two rewards has none to compare with (zeros)."""
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    total = sum(rewards)
    std = pstdev(rewards)
    advantages = [r - (total - r) / (n - 1) for r in rewards]
    if std > 0:
        advantages = [a / std for a in advantages]
    return advantages
