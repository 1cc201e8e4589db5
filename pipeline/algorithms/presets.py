"""The algorithm a recipe names: presets, and `resolve` from the recipe's knobs to one typed
`Algorithm` (what the stages and every trainer backend read; never the recipe itself).

| preset  | advantage | policy_loss | loss_aggregation | clip low, high | dynamic sampling | overlong buffer |
|---------|-----------|-------------|------------------|----------------|------------------|-----------------|
| grpo    | grpo      | token       | token_mean       | 0.2, 0.28      | no               | 0               |
| dr_grpo | dr_grpo   | token       | token_sum        | 0.2, 0.28      | no               | 0               |
| dapo    | grpo      | token       | token_mean       | 0.2, 0.28      | yes              | budget / 4      |
| gspo    | grpo      | sequence    | sequence_mean    | 3e-4, 4e-4     | no               | 0               |
| rloo    | rloo      | token       | token_mean       | 0.2, 0.28      | no               | 0               |

`grpo` is what this project trained before presets existed (a token mean over the minibatch);
the GRPO paper's sequence mean of token means is `loss_aggregation: sequence_mean`.

The response budget (`budget` above; what `token_sum` divides by and where the overlong penalty
ends) is the longest response a sample may have: `rollout.max_new_tokens`, or with an
environment `rollout.max_episode_tokens` (an episode's response is everything after the prompt,
its turns and the environment's replies).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pipeline.algorithms.config import Algorithm
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


def resolve(
    train: Any,
    *,
    max_response_tokens: int,
    samples_per_prompt: int,
    budget_field: str = "rollout.max_new_tokens",
) -> Algorithm:
    """The `Algorithm` of a recipe's `train` section: its preset, then each knob it sets, for
    responses of at most `max_response_tokens` (the recipe's `budget_field`). Raises
    `RecipeError` naming the field for an unknown part or a combination that cannot run."""
    knobs = {k: knob(train, k, max_response_tokens=max_response_tokens) for k in KNOBS}
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
        max_response_tokens=max_response_tokens,
        **knobs,
    )
    # Each name resolves (the losses' modules import torch: only here, not at import).
    from pipeline.algorithms.aggregation import AGGREGATIONS
    from pipeline.algorithms.losses import LOSSES

    algorithm.advantages(), LOSSES.get(algorithm.policy_loss), AGGREGATIONS.get(algorithm.loss_aggregation)
    if algorithm.overlong_buffer >= max_response_tokens:
        raise RecipeError(
            f"train.overlong_buffer: {algorithm.overlong_buffer} must be below {budget_field} "
            f"({max_response_tokens}): the penalty would start before the first token"
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
    episodes = rollout.environment is not None
    return resolve(
        recipe.train,
        max_response_tokens=rollout.max_episode_tokens if episodes else rollout.max_new_tokens,
        samples_per_prompt=rollout.samples_per_prompt,
        budget_field="rollout.max_episode_tokens" if episodes else "rollout.max_new_tokens",
    )


def knob(train: Any, name: str, *, max_response_tokens: int = 0) -> Any:
    """One knob's value: the recipe's where it sets it, else its preset's, else grpo's."""
    value = getattr(train, name)
    if value is not None:
        return value
    preset = PRESETS[train.algorithm]
    if name == "overlong_buffer":
        return int(max_response_tokens * preset.get("overlong_fraction", 0.0))
    if name in ("clip_low", "clip_high"):
        return preset.get(name, getattr(Algorithm().loss, name))
    return preset.get(name, getattr(Algorithm(), name))
