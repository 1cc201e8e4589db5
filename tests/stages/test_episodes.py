"""Multi-turn episodes (stages/episodes.py) on fake time: the sequence a three-turn episode
leaves (every token where the engine and the environment put it, the loss mask, the logprobs),
the deadlines across a stand-down (a turn's is credited, an environment call's is not),
environment failures counted and budgeted, and an episode with a non-finite turn poisoned."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from pipeline.algorithms.update import Chunk
from pipeline.clock import DeadlineClock
from pipeline.contracts.environments import Observation, Turn
from pipeline.contracts.errors import DropBudgetExceeded
from pipeline.contracts.messages import Completion, Prompt, TrainGroup, TrainSample
from pipeline.gate import EngineGate
from pipeline.logs import reset_warnings
from pipeline.testing import FakeEngine, FakeTime, FakeTrainer
from stages.chat_turns import ChatTurns
from stages.episodes import Episode, Episodes
from stages.rollout import GiveUp, RolloutSection
from stages.tokenizer import CharTokenizer, Tokenizer
from tests.stages.test_flow import drive, make_recipe, metrics

TOKENIZER = CharTokenizer("0123456789=<>?")
PROMPT = Prompt(prompt_id="p0", text="12?", tokens=tuple(TOKENIZER.encode("12?")), answer="7")


class ScriptedEngine(FakeEngine):
    """Answers call k with two tokens, 3+k and the end-of-sequence token, with logprobs
    -(k+1)/10 and -(k+1)/100; records each context it was given."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.contexts: list[tuple[int, ...]] = []

    async def generate(
        self, prompt_tokens: Sequence[int], n: int, *, greedy: bool = False, episode: str | None = None
    ) -> list[Completion]:
        call = self.calls
        self.calls += 1
        self.contexts.append(tuple(prompt_tokens))
        return [
            Completion(
                tokens=(3 + call, TOKENIZER.eos_id),
                logprobs=(-(call + 1) / 10, -(call + 1) / 100),
                finish_reason="stop",
            )
        ] * n


class Replies:
    """Answers turn k with `replies[k]` (text), done at the third turn with reward 1."""

    replies = ("<", ">>")

    def __init__(self) -> None:
        self.turns: list[Turn] = []

    async def start(self, prompt: Prompt) -> Observation:
        return Observation(text="?")

    async def step(self, turn: Turn) -> Observation:
        self.turns.append(turn)
        if turn.index == 2:
            return Observation(text="=", reward=1.0, done=True, info={"success": 1.0})
        return Observation(text=self.replies[turn.index], reward=0.25)


async def _play(
    env: Callable[[], Any],
    engine: FakeEngine,
    fake: FakeTime,
    *,
    during: Callable[[EngineGate], Awaitable[None]] | None = None,
    counts: Counter[str] | None = None,
    prompt: Prompt = PROMPT,
    tokenizer: Tokenizer = TOKENIZER,
    chat: ChatTurns | None = None,
    **section: Any,
) -> tuple[Episode | BaseException, float]:
    """One episode from `prompt` (and `during(gate)` beside it); its result, or what it raised,
    and the fake time when it ended."""
    clock = DeadlineClock(source=fake)
    gate = EngineGate(engine, clock)
    episodes = Episodes(
        RolloutSection(**{"max_retries": 0, **section}),
        factory=env,
        tokenizer=tokenizer,
        gate=gate,
        clock=clock,
        chat=chat,
    )
    out: dict[str, Any] = {}

    async def episode() -> None:
        try:
            out["result"] = await episodes.run(prompt, counts=counts if counts is not None else Counter())
        except Exception as error:
            out["result"] = error
        out["at"] = fake.now()

    async with anyio.create_task_group() as tg:
        tg.start_soon(fake.autojump)
        tg.start_soon(clock.run)
        await anyio.wait_all_tasks_blocked()
        async with anyio.create_task_group() as both:
            both.start_soon(episode)
            if during is not None:
                both.start_soon(during, gate)
        tg.cancel_scope.cancel()
    return out["result"], out["at"]


async def test_a_three_turn_episode_is_token_exact_with_the_environment_masked_out() -> None:
    env = Replies()
    engine = ScriptedEngine()
    episode, _ = await _play(lambda: env, engine, FakeTime(), episode_reward="sum")
    assert isinstance(episode, Episode)
    eos, start, lt, gt = TOKENIZER.eos_id, TOKENIZER.encode_plain("?"), *TOKENIZER.encode_plain("<>")
    turns = [(3, eos), (4, eos), (5, eos)]
    # start observation, turn 0, "<", turn 1, ">>", turn 2 (the ending "=" adds nothing)
    assert episode.tokens == (*start, *turns[0], lt, *turns[1], gt, gt, *turns[2])
    assert episode.loss_mask == (0, 1, 1, 0, 1, 1, 0, 0, 1, 1)
    assert episode.logprobs == (0.0, -0.1, -0.01, 0.0, -0.2, -0.02, 0.0, 0.0, -0.3, -0.03)
    # Each turn continued the whole context exactly as generated, no re-tokenisation.
    assert engine.contexts == [PROMPT.tokens + episode.tokens[:n] for n in (1, 4, 8)]
    assert [t.tokens for t in env.turns] == turns
    assert [t.text for t in env.turns] == ["0", "1", "2"]
    assert episode.reward == pytest.approx(1.5)  # sum: 0.25 + 0.25 + 1
    assert episode.info == {"success": 1.0}
    assert (episode.stats.turns, episode.stats.truncated, episode.stats.env_calls) == (3, False, 4)
    assert episode.stats.reprefilled_tokens == 2 * len(PROMPT.tokens) + 4 + 8
    # What the trainer computes its loss and mismatch metrics over: the model's tokens only.
    sample = TrainSample(
        tokens=episode.tokens,
        logprobs=episode.logprobs,
        reward=1.5,
        advantage=1.0,
        loss_mask=episode.loss_mask,
    )
    chunk = Chunk.of([sample], None, torch.device("cpu"))
    assert chunk.mask.tolist() == [list(map(float, episode.loss_mask))]
    assert chunk.gen[chunk.mask.bool()].tolist() == pytest.approx([-0.1, -0.01, -0.2, -0.02, -0.3, -0.03])


async def test_final_reward_is_the_last_turns() -> None:
    episode, _ = await _play(Replies, ScriptedEngine(), FakeTime(), episode_reward="final")
    assert isinstance(episode, Episode) and episode.reward == 1.0


@pytest.mark.parametrize(
    ("limits", "turns"),
    [({"max_turns": 2}, 2), ({"max_episode_tokens": 9, "max_new_tokens": 2}, 2)],
    ids=["max_turns", "token_budget"],
)
async def test_an_episode_past_a_limit_is_truncated(limits: dict[str, int], turns: int) -> None:
    episode, _ = await _play(Replies, ScriptedEngine(), FakeTime(), **limits)
    assert isinstance(episode, Episode)
    assert (episode.stats.turns, episode.stats.truncated) == (turns, True)
    assert episode.reward == 0.25  # final: the last observation's


class Hangs:
    """An environment whose first step never answers."""

    async def start(self, prompt: Prompt) -> Observation:
        return Observation()

    async def step(self, turn: Turn) -> Observation:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


def stand_down_at(at: float, seconds: float) -> Callable[[EngineGate], Awaitable[None]]:
    """A train step that stands the engine down at fake time `at` for `seconds`."""

    async def during(gate: EngineGate) -> None:
        source = gate.clock.source
        await source.sleep(at)  # type: ignore[attr-defined]
        await gate.step(lambda: source.sleep(seconds))  # type: ignore[attr-defined]

    return during


async def test_a_turn_deadline_is_credited_during_a_stand_down() -> None:
    """A turn of two 20 s tokens, the second frozen by a stand-down from 10 s to 1010 s,
    finishes at 1030 s within turn_s 50: the time stood down is not charged to it."""
    fake = FakeTime()
    engine = FakeEngine(time=fake, latency=40.0, response_len=2, partial_rollouts=True)
    counts: Counter[str] = Counter()
    episode, at = await _play(
        Replies, engine, fake, during=stand_down_at(10.0, 1000.0), counts=counts, turn_s=50.0, max_turns=1
    )
    assert isinstance(episode, Episode), episode
    assert episode.stats.turns == 1 and counts["timeouts"] == 0
    assert at == pytest.approx(1030.0)


@pytest.mark.parametrize(
    ("turn_s", "timeouts"),
    [(70.0, 3), (61.5, 3), (200.0, 3)],
    ids=["in-an-attempt", "in-a-backoff", "attempts-run-out"],
)
async def test_a_turn_deadline_ends_its_retries_and_backoffs(turn_s: float, timeouts: int) -> None:
    """Attempts that hang past generation_s 30 are retried after backoffs of 1 s and 2 s (0-30,
    31-61, 63-93 s): turn_s ends the turn where it falls, in an attempt or a backoff, with no
    further retry, counted as one timeout beside the attempts' that timed out; a turn_s past
    them gives up with the attempts' reason."""
    fake = FakeTime()
    counts: Counter[str] = Counter()
    result, at = await _play(
        Replies,
        FakeEngine(time=fake, latency=1000.0),
        fake,
        counts=counts,
        turn_s=turn_s,
        generation_s=30.0,
        max_retries=2,
        backoff_s=1.0,
    )
    assert isinstance(result, GiveUp), result
    if turn_s < 93:
        assert result.reason == "turn_timeout" and at == pytest.approx(turn_s)
    else:
        assert result.reason == "generation_timeout" and at == pytest.approx(93.0)
    assert counts["timeouts"] == timeouts and counts["retries"] == 2


async def test_an_environment_deadline_runs_on_through_a_stand_down() -> None:
    """An environment step that hangs from 0 s fails its episode at env_s 50, though the engine
    stood down from 10 s to 1010 s: the environment kept running, so its deadline did too."""
    fake = FakeTime()
    counts: Counter[str] = Counter()
    episode, at = await _play(
        Hangs, FakeEngine(time=fake), fake, during=stand_down_at(10.0, 1000.0), counts=counts, env_s=50.0
    )
    assert isinstance(episode, Episode), episode
    assert episode.reward is None
    assert episode.stats.failed == "step took longer than rollout.env_s=50 s"
    assert at == pytest.approx(50.0)
    assert counts["env_failures"] == 1


class Raises(Replies):
    async def step(self, turn: Turn) -> Observation:
        raise KeyError("board")


class Malformed(Replies):
    async def step(self, turn: Turn) -> Observation:
        return {"text": "<"}  # type: ignore[return-value]


class NotFinite(Replies):
    async def step(self, turn: Turn) -> Observation:
        return Observation(text="<", reward=float("nan"))


class OutOfVocabulary(Replies):
    async def step(self, turn: Turn) -> Observation:
        return Observation(tokens=(999,))


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        (Raises, "step raised KeyError: 'board'"),
        (Malformed, "step returned dict, not an Observation"),
        (NotFinite, "step returned non-finite values: {'reward': nan}"),
        (OutOfVocabulary, "observation tokens outside the vocabulary: [999]"),
    ],
    ids=["raises", "malformed", "non-finite", "out-of-vocabulary"],
)
async def test_an_environment_failure_fails_its_episode_and_is_counted(
    env: Callable[[], Any], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    reset_warnings()  # each kind of failure is warned of once a run
    counts: Counter[str] = Counter()
    episode, _ = await _play(env, ScriptedEngine(), FakeTime(), counts=counts)
    assert isinstance(episode, Episode)
    assert (episode.reward, episode.stats.failed, counts["env_failures"]) == (None, reason, 1)
    assert reason in caplog.text


async def test_environment_failures_past_the_budget_stop_the_run() -> None:
    counts: Counter[str] = Counter(env_failures=2)
    raised, _ = await _play(Raises, ScriptedEngine(), FakeTime(), counts=counts, max_env_failures=2)
    assert isinstance(raised, DropBudgetExceeded)
    assert str(raised) == (
        "3 episodes failed by their environment, over rollout.max_env_failures=2; "
        "last: step raised KeyError: 'board'"
    )


class TwoTurns:
    """Replies `reply` twice (tokens) to the first turn; ends the episode at the second, reward 0.5."""

    def __init__(self, reply: int = 5) -> None:
        self.reply = reply

    async def start(self, prompt: Prompt) -> Observation:
        return Observation()

    async def step(self, turn: Turn) -> Observation:
        if turn.index == 1:
            return Observation(reward=0.5, done=True, info={"won": 1.0})
        return Observation(tokens=(self.reply, self.reply))


@pytest.mark.parametrize("partial", [False, True], ids=["whole-turns", "partial"])
async def test_the_pipeline_trains_episodes_with_their_environment_tokens_masked(
    tmp_path: Path, partial: bool
) -> None:
    """The whole pipeline on fakes, colocated, L 1: every episode reaches the trainer with its
    loss mask and the environment's reward (the reward function is not called), and the step
    records carry env/*. With partial rollouts the next batch's turns freeze at each stand-down
    and continue under the new weights: episodes span versions mid-episode."""
    fake = FakeTime()
    recipe = make_recipe(
        tmp_path,
        steps=3,
        lookahead=1,
        colocated=True,
        rollout={
            "samples_per_prompt": 2,
            "partial": partial,
            "max_new_tokens": 4,
            "environment": "tests.stages.test_episodes:TwoTurns",
            "environment_args": {"reply": 7},
        },
        reward={"function": "tests.stages.test_episodes:never_called", "reward_s": 1.0e9},
    )
    trained: list[TrainGroup] = []
    # Batch 0's turns (calls 0-3, then 8-11) take 8 s, batch 1's first turns (calls 4-7) 40 s:
    # step 1 (batch 0) stands down at 16 s while batch 1's first turns are in flight.
    engine = FakeEngine(
        time=fake, latency=lambda call: 40.0 if 4 <= call < 8 else 8.0, partial_rollouts=partial
    )
    trainer = FakeTrainer(time=fake, latency=20.0, on_step=lambda version, groups: trained.extend(groups))
    summary = await drive(recipe, engine, trainer, fake)
    assert summary.steps_done == 3
    samples = [s for g in trained for s in g.samples]
    assert samples and all(s.loss_mask == (1, 1, 1, 1, 0, 0, 1, 1, 1, 1) for s in samples)
    assert all(s.tokens[4:6] == (7, 7) and s.reward == 0.5 for s in samples)
    records = metrics(recipe)
    assert [
        (r["env/turns_mean"], r["env/turns_max"], r["env/truncated"], r["env/failures"]) for r in records
    ] == [(2.0, 2, 0, 0)] * 3
    assert all(r["reward/won"] == 1.0 for r in records)
    assert (engine.frozen > 0) == partial
    assert (sum(r["rollout/partial_samples"] for r in records) > 0) == partial


async def test_an_episode_with_a_non_finite_turn_is_poisoned_and_never_trained(tmp_path: Path) -> None:
    """L 0: calls 0-3 are batch 0's first turns, 4-7 its second; call 5 gives NaN logprobs, so
    one episode's second turn is non-finite: that episode is marked poisoned (counted in the
    step record) and none of its logprobs reaches the trainer."""
    fake = FakeTime()
    recipe = make_recipe(
        tmp_path,
        steps=2,
        lookahead=0,
        rollout={
            "samples_per_prompt": 2,
            "max_new_tokens": 4,
            "environment": "tests.stages.test_episodes:TwoTurns",
        },
    )
    trained: list[TrainGroup] = []
    engine = FakeEngine(time=fake, latency=1.0, nonfinite_calls=[5])
    trainer = FakeTrainer(time=fake, on_step=lambda version, groups: trained.extend(groups))
    summary = await drive(recipe, engine, trainer, fake)
    assert summary.steps_done == 2
    assert trained and all(math.isfinite(x) for g in trained for s in g.samples for x in s.logprobs)
    assert [r["rollout/poisoned_samples"] for r in metrics(recipe)] == [1, 0]


def never_called(prompt: Prompt, completion: str) -> float:
    raise AssertionError("with an environment, the reward function is not called")


class AlwaysRaises(TwoTurns):
    async def step(self, turn: Turn) -> Observation:
        raise RuntimeError("the board caught fire")


async def test_environment_failures_past_the_budget_stop_the_pipeline(tmp_path: Path) -> None:
    """Through the whole pipeline: the third failed episode is over max_env_failures 2 and the
    run stops with that one error, before any step trains."""
    fake = FakeTime()
    recipe = make_recipe(
        tmp_path,
        steps=2,
        rollout={
            "samples_per_prompt": 2,
            "environment": "tests.stages.test_episodes:AlwaysRaises",
            "max_env_failures": 2,
        },
    )
    trainer = FakeTrainer(time=fake)
    with pytest.raises(DropBudgetExceeded) as raised:
        await drive(recipe, FakeEngine(time=fake, latency=1.0), trainer, fake)
    assert str(raised.value) == (
        "3 episodes failed by their environment, over rollout.max_env_failures=2; "
        "last: step raised RuntimeError: the board caught fire"
    )
    assert trainer.steps == []


class Closes(Replies):
    """Counts its `close` calls; `broken`: each raises."""

    broken = False

    def __init__(self) -> None:
        super().__init__()
        self.closed = 0

    def close(self) -> None:
        self.closed += 1
        if self.broken:
            raise OSError("socket already closed")


class ClosesAndRaises(Closes):
    async def step(self, turn: Turn) -> Observation:
        raise KeyError("board")


@pytest.mark.parametrize("broken", [False, True], ids=["closes", "close-raises"])
@pytest.mark.parametrize("env_type", [Closes, ClosesAndRaises], ids=["done", "failed"])
async def test_an_environment_is_closed_once_and_a_close_that_raises_is_a_warning(
    env_type: type[Closes], broken: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """An episode ended (done or failed) has its environment's close() called once; a close
    that raises is warned of, the episode as it was (not a traceback that stops the run)."""
    reset_warnings()
    env = env_type()
    env.broken = broken
    episode, _ = await _play(lambda: env, ScriptedEngine(), FakeTime())
    assert isinstance(episode, Episode), episode
    assert env.closed == 1
    assert episode.stats.failed == ("" if env_type is Closes else "step raised KeyError: 'board'")
    assert ("close() raised OSError: socket already closed" in caplog.text) == broken
