"""Advantage estimators: one group's rewards in, one advantage per sample out.

Registered by name for `train.advantage`; a user's own is `module:function` with the same
signature, `(rewards: Sequence[float]) -> list[float]`. A group of fewer than two rewards has
nothing to compare with: every estimator gives it zeros.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from pipeline.algorithms.registry import Registry

AdvantageFn = Callable[[Sequence[float]], list[float]]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator", "train.advantage")


@ADVANTAGES.register("grpo")
def grpo(rewards: Sequence[float]) -> list[float]:
    """Reward minus the leave-one-out mean of the others, over the group's std when above 0."""
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    std = population_std(rewards)
    advantages = rloo(rewards)
    return [a / std for a in advantages] if std > 0 else advantages


@ADVANTAGES.register("rloo")
def rloo(rewards: Sequence[float]) -> list[float]:
    """REINFORCE leave-one-out: reward minus the mean of the group's other rewards."""
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    total = sum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


@ADVANTAGES.register("dr_grpo")
def dr_grpo(rewards: Sequence[float]) -> list[float]:
    """Dr. GRPO: reward minus the group mean, not divided by the std (no difficulty bias)."""
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    mean = math.fsum(rewards) / n
    return [r - mean for r in rewards]


def population_std(values: Iterable[float]) -> float:
    """Population standard deviation in floating point (`statistics.pstdev` computes it in
    exact fractions: milliseconds a step on the event loop)."""
    xs = list(values)
    if max(xs) == min(xs):  # exactly 0, as rounding in the mean must not make it tiny
        return 0.0
    mean = math.fsum(xs) / len(xs)
    return math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / len(xs))
