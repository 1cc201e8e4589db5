"""The algorithm a recipe names: presets, and `resolve` from the recipe's knobs to one typed
`Algorithm` (what the stages and every trainer backend read; never the recipe itself).

| preset  | advantage | policy_loss | loss_aggregation | clip low, high | dynamic sampling | overlong buffer |
|---------|-----------|-------------|------------------|----------------|------------------|-----------------|
| grpo    | grpo      | token       | token_mean       | 0.2, 0.28      | no               | 0               |
| dr_grpo | dr_grpo   | token       | token_sum        | 0.2, 0.28      | no               | 0               |
| dapo    | grpo      | token       | token_mean       | 0.2, 0.28      | yes              | max_new / 4     |
| gspo    | grpo      | sequence    | sequence_mean    | 3e-4, 4e-4     | no               | 0               |
| rloo    | rloo      | token       | token_mean       | 0.2, 0.28      | no               | 0               |

`grpo` is what this project trained before presets existed (a token mean over the minibatch);
the GRPO paper's sequence mean of token means is `loss_aggregation: sequence_mean`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from pipeline.algorithms.advantages import ADVANTAGES, AdvantageFn
from pipeline.contracts.errors import RecipeError

PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {},
    "dr_grpo": {"advantage": "dr_grpo", "loss_aggregation": "token_sum"},
    "dapo": {"dynamic_sampling": True, "overlong_fraction": 0.25},
    "gspo": {
        "policy_loss": "sequence",
        "loss_aggregation": "sequence_mean",
        "clip_low": 3e-4,
        "clip_high": 4e-4,
    },
    "rloo": {"advantage": "rloo"},
}
KNOBS = (
    "advantage",
    "policy_loss",
    "loss_aggregation",
    "clip_low",
    "clip_high",
    "dynamic_sampling",
    "overlong_buffer",
)


@dataclass(frozen=True)
class LossConfig:
    """The policy loss's options: the clip range, the reference KL's weight, the off-policy
    importance-sampling correction (none | tis | icepop) and its cap."""

    clip_low: float
    clip_high: float
    kl_coef: float
    is_correction: str
    is_cap: float


@dataclass(frozen=True)
class Algorithm:
    """What an RL step computes, resolved once from the recipe (defaults: `grpo`)."""

    loss: LossConfig = field(default_factory=lambda: LossConfig(0.2, 0.28, 0.0, "tis", 2.0))
    name: str = "grpo"
    advantage: str = "grpo"
    policy_loss: str = "token"
    loss_aggregation: str = "token_mean"
    dynamic_sampling: bool = False  # filter groups whose rewards are all equal, and refill
    overlong_buffer: int = 0  # tokens before max_new_tokens where the soft length penalty starts
    overlong_penalty: float = 1.0  # the penalty at max_new_tokens
    max_new_tokens: int = 0
    oversample: float = 2.0  # with dynamic sampling: prompts admitted a step / prompts_per_step

    def admitted(self, prompts_per_step: int) -> int:
        """Prompts admitted for one step: over-admitted by `oversample` with dynamic sampling."""
        if not self.dynamic_sampling:
            return prompts_per_step
        return math.ceil(prompts_per_step * self.oversample)

    def advantages(self) -> AdvantageFn:
        return ADVANTAGES.get(self.advantage)

    def overlong(self, length: int) -> float:
        """DAPO's soft overlong penalty for a response of `length` tokens: 0 up to
        `max_new_tokens - overlong_buffer`, then falling linearly to -`overlong_penalty` at
        `max_new_tokens` (and below it past that)."""
        if not self.overlong_buffer:
            return 0.0
        start = self.max_new_tokens - self.overlong_buffer
        if length <= start:
            return 0.0
        return -self.overlong_penalty * min(1.0, (length - start) / self.overlong_buffer)


def resolve(train: Any, *, max_new_tokens: int, samples_per_prompt: int) -> Algorithm:
    """The `Algorithm` of a recipe's `train` section: its preset, then each knob it sets.
    Raises `RecipeError` naming the field for an unknown part or a combination that cannot run."""
    knobs = {k: knob(train, k, max_new_tokens=max_new_tokens) for k in KNOBS}
    base = Algorithm()
    loss = replace(
        base.loss,
        clip_low=knobs.pop("clip_low", base.loss.clip_low),
        clip_high=knobs.pop("clip_high", base.loss.clip_high),
        kl_coef=train.kl_coef,
        is_correction=train.is_correction,
        is_cap=train.is_cap,
    )
    algorithm = Algorithm(
        loss=loss,
        name=train.algorithm,
        overlong_penalty=train.overlong_penalty,
        oversample=train.oversample,
        max_new_tokens=max_new_tokens,
        **knobs,
    )
    # Each name resolves (the losses' modules import torch: only here, not at import).
    from pipeline.algorithms.aggregation import AGGREGATIONS
    from pipeline.algorithms.losses import LOSSES

    algorithm.advantages(), LOSSES.get(algorithm.policy_loss), AGGREGATIONS.get(algorithm.loss_aggregation)
    if algorithm.overlong_buffer >= max_new_tokens:
        raise RecipeError(
            f"train.overlong_buffer: {algorithm.overlong_buffer} must be below rollout.max_new_tokens "
            f"({max_new_tokens}): the penalty would start before the first token"
        )
    if algorithm.dynamic_sampling and samples_per_prompt < 2:
        raise RecipeError(
            "train.dynamic_sampling needs rollout.samples_per_prompt >= 2 (a group of one always "
            f"has equal rewards; it is {samples_per_prompt}), or train.dynamic_sampling: false"
        )
    return algorithm


def algorithm_of(recipe: Any) -> Algorithm:
    """The `Algorithm` of a whole recipe (its `train` and `rollout` sections)."""
    rollout = recipe.rollout
    return resolve(
        recipe.train, max_new_tokens=rollout.max_new_tokens, samples_per_prompt=rollout.samples_per_prompt
    )


def knob(train: Any, name: str, *, max_new_tokens: int = 0) -> Any:
    """One knob's value: the recipe's where it sets it, else its preset's, else grpo's."""
    value = getattr(train, name)
    if value is not None:
        return value
    preset = PRESETS[train.algorithm]
    if name == "overlong_buffer":
        return int(max_new_tokens * preset.get("overlong_fraction", 0.0))
    if name in ("clip_low", "clip_high"):
        return preset.get(name, getattr(Algorithm().loss, name))
    return preset.get(name, getattr(Algorithm(), name))
