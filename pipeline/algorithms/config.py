"""The typed algorithm a run trains with: what the stages (advantages, reward shaping, group
filtering) and every trainer backend (loss, aggregation) read, built once from the recipe by
`pipeline.algorithms.presets.resolve`. Imports no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pipeline.algorithms.advantages import ADVANTAGES, AdvantageFn


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
    overlong_buffer: int = 0  # tokens before max_response_tokens where the soft length penalty starts
    overlong_penalty: float = 1.0  # the penalty at max_response_tokens
    # The longest response a sample may have: rollout.max_new_tokens, or with an environment
    # rollout.max_episode_tokens (everything after the prompt).
    max_response_tokens: int = 0
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
        `max_response_tokens - overlong_buffer`, then falling linearly to -`overlong_penalty` at
        `max_response_tokens` (and below it past that)."""
        if not self.overlong_buffer:
            return 0.0
        start = self.max_response_tokens - self.overlong_buffer
        if length <= start:
            return 0.0
        return -self.overlong_penalty * min(1.0, (length - start) / self.overlong_buffer)
