"""The environment contract: what a multi-turn rollout talks to between generation turns.

An episode is one sample of a group. The rollout builds one environment object per episode
from the recipe (`rollout.environment: module:Class`, called with `rollout.environment_args` as
keyword arguments), then:

    observation = await env.start(prompt)          # once, before the first turn
    while not observation.done:
        turn = <the model's reply to the whole context so far>
        observation = await env.step(turn)

`start` gets the prompt as the source gave it (`prompt.text`, `prompt.answer`, `prompt.prompt_id`);
its observation is appended to the prompt's tokens before the first turn (an empty one adds
nothing). `step` gets the model's turn: its decoded text (up to the end-of-sequence token) and
the exact tokens the engine produced. Each observation's text (or tokens) enters the sequence
after the turn, with loss mask 0: the model is trained only on its own tokens. With
`prompts.chat_template: true` the episode is a chat: each observation is text, a message of
`rollout.observation_role` (`tool` by default) that the model's chat template renders between
the turns, and `start`'s observation must be empty (the prompt is the whole first user turn).

The episode's reward is, as `rollout.episode_reward` says, the sum of the turns' rewards
(`sum`: a turn without one counts 0) or the last turn's reward (`final`: the observation that
ended the episode; none given counts 0). `info` values of the observation that ends the episode
are logged as `reward/<key>` (and `eval/<key>`), as a reward function's extra keys are.

Both methods are coroutines and run on the event loop: an environment with blocking work
hands it to a thread itself. Each call runs under `rollout.env_s` of wall time (it is not
suspended while the engine stands down: the environment keeps running). An environment that
raises an `Exception`, overruns `env_s` or returns something other than an `Observation` (or
non-finite rewards) fails its episode: the sample is not trained on, and the failure is counted
against `rollout.max_env_failures`. A single-turn reward function (`reward.function`) is the
one-turn case and needs no environment.

An environment that holds something to let go of has a `close()` method (`ClosingEnvironment`):
it is called once, when its episode ends, however it ends (done, truncated, failed, cancelled).
One that raises is warned of; the episode stays as it ended.

With `placement.environment_workers` (Ray) each episode's environment is built and run in an
environment-worker actor (`backends/ray/environments.py`) under the same deadlines and failure
budget; a worker that dies fails the episodes whose environments it held.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import msgspec

from pipeline.contracts.messages import Prompt


class Observation(msgspec.Struct, frozen=True, kw_only=True):
    """What the environment answers: `text` (encoded with the run's tokenizer, no special tokens
    added) or `tokens` (ids of the run's vocabulary, used as they are), not both; the turn's
    `reward` (None: none for this turn); `done` ends the episode."""

    text: str = ""
    tokens: tuple[int, ...] | None = None
    reward: float | None = None
    done: bool = False
    info: dict[str, float] = msgspec.field(default_factory=dict)


class Turn(msgspec.Struct, frozen=True, kw_only=True):
    """One generation turn as the environment sees it."""

    text: str  # decoded, up to the end-of-sequence token
    tokens: tuple[int, ...]  # exactly what the engine generated (its stop token included)
    finish_reason: str  # "stop" | "length"
    index: int  # 0 for the first turn


class Environment(Protocol):
    """One episode's environment (a fresh object per episode)."""

    async def start(self, prompt: Prompt) -> Observation: ...

    async def step(self, turn: Turn) -> Observation: ...


@runtime_checkable
class ClosingEnvironment(Protocol):
    """An environment with something to let go of once its episode ends (module docstring)."""

    def close(self) -> None:
        """Called once, when the episode ends; synchronous (it may not wait on anything)."""
        ...
