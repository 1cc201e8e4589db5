"""Messages that flow between stages: frozen records carrying their provenance.

Every generated sample knows its prompt, group, index in the group, the batch (`target_step`) it
was admitted for, and the weights version at its first and last generated token. Work that is
given up is a `Dropped` record with a reason, so every admitted prompt ends either trained or
dropped and the counts close.

A `Group` holds its prompt once; its samples do not repeat it. What crosses to the trainer is a
`TrainGroup`: the prompt's tokens once, and each usable sample with its reward and advantage.
"""

from __future__ import annotations

import msgspec


class Prompt(msgspec.Struct, frozen=True, kw_only=True):
    prompt_id: str
    text: str
    tokens: tuple[int, ...]
    answer: str = ""


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """What an engine returns for one sampled sequence.

    An engine with partial rollouts (`Engine.partial_rollouts`) may generate one sequence in
    stretches under different weights: `segments` gives, for each stretch, the index of its
    first token and the number of `wake` calls the engine had served when it generated it
    (its `wakes` then); `reprefilled_tokens` counts the tokens prefilled again to continue it
    (its prompt plus its tokens so far, at each continuation). Empty `segments`: every token
    under the weights served when the request started. `reused_tokens`: the prompt's first
    tokens whose keys and values the engine kept from the episode's previous turn (see
    `KeepsEpisodes`), not prefilled again; 0: it prefilled the whole prompt.
    """

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]  # each token's behaviour logprob, as generated
    finish_reason: str  # "stop" | "length"
    segments: tuple[tuple[int, int], ...] = ()
    reprefilled_tokens: int = 0
    reused_tokens: int = 0


class EpisodeStats(msgspec.Struct, frozen=True, kw_only=True):
    """How a multi-turn episode went (`Sample.episode`)."""

    turns: int  # generation turns
    truncated: bool  # it hit rollout.max_turns or rollout.max_episode_tokens before done
    failed: str = ""  # why its environment failed it (then it has no reward), "" if it did not
    env_s: float = 0.0  # wall seconds its environment's start and steps took, in all
    env_calls: int = 0  # its environment's start and step calls
    # Context tokens prefilled again for its turns after the first: each turn's request is the
    # whole context so far, and a turn whose engine did not continue from the keys and values it
    # kept of the last turn (`Completion.reused_tokens` 0) prefilled all of it.
    reprefilled_tokens: int = 0


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    prompt_id: str
    group_id: str
    sample_index: int
    target_step: int
    gen_version: tuple[int, int]  # the weights version of its first and its last token
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    poisoned: bool = False
    text: str = ""
    reward: float | None = None  # None: not scored (before the reward stage, or its failure)
    reward_info: dict[str, float] = msgspec.field(default_factory=dict)
    # (first token index, weights version) of each stretch generated under one version: more
    # than one when a partial rollout continued after a train step. Empty: all gen_version[0].
    versions: tuple[tuple[int, int], ...] = ()
    reprefilled_tokens: int = 0  # tokens prefilled again to continue it (partial rollouts)
    # Multi-turn episodes (`rollout.environment`): `tokens` holds every token after the prompt,
    # the model's turns and the environment's observations in order; `loss_mask` is 1 on the
    # model's tokens and 0 on the environment's, whose `logprobs` are 0.0 placeholders never
    # read. Empty: every token is the model's (single-turn, `episode` None).
    loss_mask: tuple[int, ...] = ()
    episode: EpisodeStats | None = None

    @property
    def usable(self) -> bool:
        """Trainable: finite logprobs and a reward."""
        return not self.poisoned and self.reward is not None


class Group(msgspec.Struct, frozen=True, kw_only=True):
    prompt: Prompt
    group_id: str
    target_step: int
    samples: tuple[Sample, ...]


class Dropped(msgspec.Struct, frozen=True, kw_only=True):
    prompt_id: str
    group_id: str
    target_step: int
    reason: str


class Batch(msgspec.Struct, frozen=True, kw_only=True):
    """The prompts admitted with one ticket, for one train step."""

    batch: int
    prompts: tuple[Prompt, ...]


class TrainSample(msgspec.Struct, frozen=True, kw_only=True):
    """One sample as the trainer sees it."""

    tokens: tuple[int, ...]  # the response
    logprobs: tuple[float, ...]  # behaviour logprob of each token, as generated
    reward: float
    advantage: float
    # 1: a model token, trained and in the mismatch metrics; 0: an environment's token, context
    # only (its logprob a placeholder). Empty: every token is the model's.
    loss_mask: tuple[int, ...] = ()


class TrainGroup(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt's usable samples, as `Trainer.train_step` receives them."""

    group_id: str
    prompt_tokens: tuple[int, ...]  # once per group
    samples: tuple[TrainSample, ...]
