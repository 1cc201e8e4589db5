"""Multi-turn episodes: the model's turns and an environment's replies, token-exact.

`Episodes.run(prompt)` plays one episode (`pipeline.contracts.environments` states the
contract): the environment starts from the prompt, then each turn the engine continues the
whole context (the prompt, every earlier turn exactly as generated, every observation) and the
environment answers, until it says done or a limit is hit (`rollout.max_turns`, or
`rollout.max_episode_tokens`: a turn starts only while `max_new_tokens` more tokens fit;
hitting either is `truncated`). The sample's `tokens` are everything after the prompt; the
loss mask is 1 on the model's tokens and 0 on the environment's (whose logprob placeholders are
0.0); an observation that ends the episode adds no tokens (nothing is generated after it).

Deadlines, all on the pipeline clock: each turn runs under `turn_s` of service time, its
attempts under `generation_s` and retried as a single-turn request is (`with_retries`), so a
turn is never charged for a stand-down; each environment call under `env_s` of wall time,
which keeps running through a stand-down (the environment does). A turn whose attempts run out
raises `GiveUp`, and its group is dropped as a single-turn group would be. An environment that
raises, overruns `env_s` or answers something malformed fails only its episode: it is returned
with `EpisodeStats.failed` set and no reward (never trained on), counted in `counts["env_failures"]`,
and past `max_env_failures` the run stops (`DropBudgetExceeded`). An environment with a
`close()` method has it called once its episode ends, however it ends (a close that raises
is warned of, its episode kept as it ended).

With `prompts.chat_template` (`chat`, stages/chat_turns.py) an episode is a chat through the
model's template: the tokens between two turns are the template's end of the assistant's turn,
the observation's message (of `rollout.observation_role`) and the next assistant turn's start.
Observations are then text: one given as tokens, or a non-empty one from `start` (the prompt is
the whole first user turn), fails its episode; a template that cannot continue the context
exactly stops the run (`RecipeError`).

Each turn's request carries the episode's key (`Engine.generate`'s ``episode``), so an engine
that keeps an episode's keys and values between its turns (`KeepsEpisodes`) prefills only the
tokens new since the last turn; the episode tells it when it has ended, however it ended. A turn
after the first that the engine prefilled whole (an engine that keeps nothing, or could not
reuse what it kept: `Completion.reused_tokens` 0) counts its whole context in
`EpisodeStats.reprefilled_tokens` (`env/reprefilled_tokens`): 0 when every turn reused.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, cast

import msgspec

from pipeline.clock import DeadlineClock
from pipeline.contracts.environments import ClosingEnvironment, Environment, Observation, Turn
from pipeline.contracts.errors import DeadlineExceeded, DropBudgetExceeded
from pipeline.contracts.messages import Completion, EpisodeStats, Prompt
from pipeline.contracts.protocols import KeepsEpisodes
from pipeline.gate import EngineGate
from pipeline.logs import warn_once
from stages.chat_turns import ChatTurns
from stages.rollout import GiveUp, RolloutSection, with_retries
from stages.tokenizer import Tokenizer

log = logging.getLogger("stages.episodes")


class Episode(msgspec.Struct, frozen=True, kw_only=True):
    """One played episode: what a `Sample` carries of it."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    loss_mask: tuple[int, ...]
    finish_reason: str  # its last turn's
    versions: tuple[tuple[int, int], ...]  # (first token index, weights version) of each stretch
    reward: float | None  # None: its environment failed it
    info: dict[str, float]
    stats: EpisodeStats
    # Tokens prefilled again to continue its turns frozen at a stand-down (partial rollouts).
    continued_tokens: int = 0


class EnvironmentFailed(Exception):
    """An environment call raised, overran `env_s` or answered something malformed."""


class Episodes:
    """Plays episodes against the engine behind `gate` and a fresh environment from `factory`
    each; `run` counts into its caller's `counts` (retries, timeouts, engine errors, env
    failures: the rollout stage's, or the evaluation's)."""

    def __init__(
        self,
        section: RolloutSection,
        *,
        factory: Callable[[], Environment],
        tokenizer: Tokenizer,
        gate: EngineGate,
        clock: DeadlineClock,
        chat: ChatTurns | None = None,
    ) -> None:
        self.section = section
        self.factory = factory
        self.tokenizer = tokenizer
        self.gate = gate
        self.clock = clock
        self.chat = chat
        self.vocab_size = tokenizer.vocab_size
        # Capabilities checked once (a runtime protocol's isinstance walks its members): the
        # gate's engine is fixed, and an environment's by its class.
        self.keeper = gate.engine if isinstance(gate.engine, KeepsEpisodes) else None
        self._closing: dict[type, bool] = {}

    async def run(self, prompt: Prompt, *, counts: Counter[str], greedy: bool = False) -> Episode:
        """Play one episode from `prompt`; raises `GiveUp` when a turn's generation gives up."""
        section = self.section
        tokens: list[int] = []
        logprobs: list[float] = []
        mask: list[int] = []
        versions: list[tuple[int, int]] = []
        rewards: list[float] = []
        env_s, calls, reprefilled, continued, turns = 0.0, 0, 0, 0, 0
        finish_reason, truncated = "stop", False
        last = Observation()

        def stats(failed: str = "") -> EpisodeStats:
            return EpisodeStats(
                turns=turns,
                truncated=truncated,
                failed=failed,
                env_s=env_s,
                env_calls=calls,
                reprefilled_tokens=reprefilled,
            )

        def episode(reward: float | None, info: dict[str, float], failed: str = "") -> Episode:
            return Episode(
                tokens=tuple(tokens),
                logprobs=tuple(logprobs),
                loss_mask=tuple(mask),
                finish_reason=finish_reason,
                versions=tuple(versions),
                reward=reward,
                info=info,
                stats=stats(failed),
                continued_tokens=continued,
            )

        env = self.factory()
        key = uuid.uuid4().hex  # the engine's name for this episode
        conversation = self.chat.conversation(prompt) if self.chat is not None else None
        try:
            start = self.clock.source.now()
            calls += 1
            try:
                last = await self._call(env.start(prompt), "start")
            finally:
                env_s += self.clock.source.now() - start
            if conversation is not None and not last.done and (last.text or last.tokens is not None):
                raise EnvironmentFailed(
                    "start returned an observation to put before the first turn; with "
                    "prompts.chat_template the prompt is the whole first user turn"
                )
            observed = self._tokens(last)
            while not last.done:
                if turns >= section.max_turns or len(tokens) + len(observed) + section.max_new_tokens > (
                    section.max_episode_tokens
                ):
                    truncated = True
                    break
                self._append(tokens, logprobs, mask, observed)
                completion, version = await self._turn(prompt, tokens, turns, greedy, counts, key)
                if turns and not completion.reused_tokens:
                    reprefilled += len(prompt.tokens) + len(tokens)
                base = len(tokens)
                versions.extend(
                    [(base + first, self.gate.version_after(wakes)) for first, wakes in completion.segments]
                    or [(base, version)]
                )
                tokens.extend(completion.tokens)
                logprobs.extend(completion.logprobs)
                mask.extend([1] * len(completion.tokens))
                finish_reason = completion.finish_reason
                continued += completion.reprefilled_tokens
                turn = Turn(
                    text=self.tokenizer.decode(completion.tokens),
                    tokens=completion.tokens,
                    finish_reason=completion.finish_reason,
                    index=turns,
                )
                turns += 1
                start = self.clock.source.now()
                calls += 1
                try:
                    last = await self._call(env.step(turn), "step")
                finally:
                    env_s += self.clock.source.now() - start
                if last.reward is not None:
                    rewards.append(last.reward)
                if conversation is None or last.done:
                    observed = self._tokens(last)
                else:
                    observed = conversation.after(completion.tokens, self._text(last))
        except EnvironmentFailed as failure:
            self._failed(str(failure), counts)
            return episode(None, {}, failed=str(failure))
        finally:
            if self.keeper is not None:
                self.keeper.end_episode(key)
            closing = self._closing.get(type(env))
            if closing is None:
                closing = self._closing[type(env)] = isinstance(env, ClosingEnvironment)
            if closing:
                self._close(cast(ClosingEnvironment, env))  # checked by its class
        if section.episode_reward == "sum":
            reward = math.fsum(rewards)
        else:
            reward = last.reward if last.reward is not None else 0.0
        return episode(reward, dict(last.info))

    async def _turn(
        self, prompt: Prompt, tokens: list[int], index: int, greedy: bool, counts: Counter[str], key: str
    ) -> tuple[Completion, int]:
        context = (*prompt.tokens, *tokens)

        async def attempt(number: int) -> tuple[Completion, int]:
            async with self.gate.serving() as version:
                (completion,) = await self.gate.engine.generate(context, 1, greedy=greedy, episode=key)
            return completion, version

        what = f"turn {index} of an episode of {prompt.prompt_id}"
        # The turn's deadline bounds its attempts' and backoffs' (one cancel scope an attempt).
        turn = self.clock.bound(self.section.turn_s, what)
        try:
            return await with_retries(attempt, self.section, self.clock, counts, what, within=turn)
        except DeadlineExceeded:
            counts["timeouts"] += 1
            raise GiveUp("turn_timeout") from None

    async def _call(self, call: Awaitable[Any], name: str) -> Observation:
        """Await an environment's `start` or `step` under `env_s` of wall time; anything but a
        well-formed `Observation` in time raises `EnvironmentFailed`."""
        try:
            with self.clock.fail_after(self.section.env_s, f"environment {name}", suspendable=False):
                result = await call
        except DeadlineExceeded:
            raise EnvironmentFailed(
                f"{name} took longer than rollout.env_s={self.section.env_s:g} s"
            ) from None
        except Exception as error:  # an environment's bug fails its episode, not the run
            raise EnvironmentFailed(f"{name} raised {type(error).__name__}: {error}") from None
        if not isinstance(result, Observation):
            raise EnvironmentFailed(f"{name} returned {type(result).__name__}, not an Observation")
        if result.tokens is not None and result.text:
            raise EnvironmentFailed(f"{name} returned both text and tokens")
        values = {"reward": result.reward, **result.info}
        bad = {k: v for k, v in values.items() if v is not None and not math.isfinite(v)}
        if bad:
            raise EnvironmentFailed(f"{name} returned non-finite values: {bad}")
        return result

    @staticmethod
    def _close(env: ClosingEnvironment) -> None:
        """Call the environment's close(); one that raises is warned of (its episode has ended
        and stays as it ended: a bug there does not stop the run, as on an environment worker)."""
        try:
            env.close()
        except Exception as error:
            warn_once(
                log, "environment close", "environment close() raised %s: %s", type(error).__name__, error
            )

    @staticmethod
    def _text(observation: Observation) -> str:
        """The text of the observation's message (a chat template renders text only)."""
        if observation.tokens is not None:
            raise EnvironmentFailed(
                "observation given as tokens; with prompts.chat_template it is text, a message "
                "the template renders"
            )
        return observation.text

    def _tokens(self, observation: Observation) -> tuple[int, ...]:
        """The observation's tokens (none for one that ends the episode: nothing follows it)."""
        if observation.done:
            return ()
        if observation.tokens is not None:
            bad = [t for t in observation.tokens if not 0 <= t < self.vocab_size]
            if bad:
                raise EnvironmentFailed(f"observation tokens outside the vocabulary: {bad[:3]}")
            return observation.tokens
        if not observation.text:
            return ()
        try:
            return tuple(self.tokenizer.encode_plain(observation.text, where="observation"))
        except Exception as error:  # text the tokenizer cannot encode is a malformed reply
            raise EnvironmentFailed(f"observation text: {error}") from None

    @staticmethod
    def _append(tokens: list[int], logprobs: list[float], mask: list[int], observed: tuple[int, ...]) -> None:
        tokens.extend(observed)
        logprobs.extend([0.0] * len(observed))
        mask.extend([0] * len(observed))

    def _failed(self, reason: str, counts: Counter[str]) -> None:
        counts["env_failures"] += 1
        warn_once(
            log,
            f"environment: {reason.split(':', 1)[0]}",  # one warning per kind of failure
            "environment failure, its episode not trained on: %s (further ones: env/failures)",
            reason,
        )
        if counts["env_failures"] > self.section.max_env_failures:
            raise DropBudgetExceeded(
                f"{counts['env_failures']} episodes failed by their environment, over "
                f"rollout.max_env_failures={self.section.max_env_failures}; last: {reason}"
            )
