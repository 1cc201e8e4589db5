"""The whole pipeline on fakes: versions and lag, admission, backpressure, drops, timeouts, errors.

Every test runs `stages.run.run_program` with a FakeEngine, a FakeTrainer and fake time that
jumps whenever every task is blocked, so minutes of simulated latency take milliseconds.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

import stages.wiring
from pipeline.channel import Channel
from pipeline.contracts.errors import DropBudgetExceeded, NothingTrained, StageFailed
from pipeline.contracts.messages import Batch, Dropped, Group, Sample, TrainGroup
from pipeline.metrics import REQUIRED_KEYS
from pipeline.recipe import convert
from pipeline.shell.recipe import Recipe
from pipeline.shell.run import run_program
from pipeline.testing import EngineCrash, FakeEngine, FakeTime, FakeTrainer, FaultInjector, InjectedFault
from pipeline.tickets import TicketBox
from stages.program import RunSummary
from stages.step_record import FLAT_STEPS_WARNING

PROMPTS_PER_STEP = 2

# What docs/DESIGN.md promises in every metrics line that a FakeTrainer can provide (the mismatch
# figures, train/gen_kl_error and train/token_mult_prob_error, come from a real trainer).
METRIC_KEYS = REQUIRED_KEYS - {"train/gen_kl_error", "train/token_mult_prob_error"}


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = (
            merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def make_recipe(tmp_path: Path, *, steps: int = 4, lookahead: int = 1, **sections: Any) -> Recipe:
    data = {
        "run": {"dir": str(tmp_path / "run"), "steps": steps},
        "async_rl": {"max_lookahead_versions": lookahead},
        "prompts": {"prompts_per_step": PROMPTS_PER_STEP, "source": {"kind": "synthetic", "num_heldout": 4}},
        "rollout": {"samples_per_prompt": 2},
        # Reward work runs on wall time in a worker thread; fake time jumps while it runs.
        "reward": {"reward_s": 1.0e9},
        "eval": {"every_steps": 0},
    }
    return convert(merge(data, sections), Recipe, source="test")


async def drive(
    recipe: Recipe, engine: FakeEngine, trainer: FakeTrainer, fake: FakeTime, **options: Any
) -> RunSummary:
    """run_program next to fake time's autojump; its own error (not a group) reaches the caller."""
    outcome: dict[str, Any] = {}
    async with anyio.create_task_group() as tg:
        tg.start_soon(fake.autojump)
        try:
            outcome["summary"] = await run_program(
                recipe, engine=engine, trainer=trainer, time_source=fake, **options
            )
        except Exception as error:
            outcome["error"] = error
        tg.cancel_scope.cancel()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["summary"]


def metrics(recipe: Recipe) -> list[dict[str, Any]]:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in metrics.jsonl")

    text = (Path(recipe.run.dir) / "metrics.jsonl").read_text()
    return [json.loads(line, parse_constant=refuse) for line in text.splitlines()]


@pytest.fixture
def fake() -> FakeTime:
    return FakeTime()


@pytest.fixture
def channels(monkeypatch: pytest.MonkeyPatch) -> dict[str, Channel[Any]]:
    """Every channel run_program creates, by name, so tests can read their statistics."""
    made: dict[str, Channel[Any]] = {}

    class RecordingChannel(Channel):  # type: ignore[type-arg]
        def __init__(self, name: str, capacity: int) -> None:
            super().__init__(name, capacity)
            made[name] = self

    monkeypatch.setattr(stages.wiring, "Channel", RecordingChannel)
    return made


@pytest.fixture
def tickets(monkeypatch: pytest.MonkeyPatch) -> list[TicketBox]:
    made: list[TicketBox] = []

    class RecordingTicketBox(TicketBox):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(stages.wiring, "TicketBox", RecordingTicketBox)
    return made


class RecordingEngine(FakeEngine):
    """Adds a `generate` event, so the exact interleaving with train/refit/wake can be asserted."""

    async def generate(
        self, prompt_tokens: Sequence[int], n: int, *, greedy: bool = False, episode: str | None = None
    ) -> Any:
        self.events.append("generate")
        return await super().generate(prompt_tokens, n, greedy=greedy, episode=episode)


# -- versions and lag ------------------------------------------------------------------------


@pytest.mark.parametrize("lookahead", [1, 2])
async def test_lag_reaches_but_never_exceeds_lookahead(
    tmp_path: Path, fake: FakeTime, scored: dict[str, Group], lookahead: int
) -> None:
    lags: list[int] = []

    def on_step(version: int, groups: Sequence[TrainGroup]) -> None:
        lags.extend(version - s.gen_version[0] for g in groups for s in scored[g.group_id].samples)

    recipe = make_recipe(tmp_path, steps=5, lookahead=lookahead)
    # Separate engine (keeps serving while training), fast generation, slow trainer.
    engine = FakeEngine(time=fake, latency=1.0, blocks_training=False)
    trainer = FakeTrainer(time=fake, latency=20.0, on_step=on_step)
    summary = await drive(recipe, engine, trainer, fake)
    assert summary.steps_done == 5
    assert max(lags) == lookahead
    assert min(lags) >= 0
    assert [m["rollout/max_lag"] for m in metrics(recipe)][-1] == lookahead
    assert all(m["rollout/max_lag"] <= lookahead for m in metrics(recipe))


async def test_lookahead_zero_generates_each_batch_after_the_previous_step_is_published(
    tmp_path: Path, fake: FakeTime
) -> None:
    events: list[str] = []
    recipe = make_recipe(tmp_path, steps=3, lookahead=0)
    engine = RecordingEngine(time=fake, latency=1.0, blocks_training=False, events=events)
    trainer = FakeTrainer(time=fake, latency=20.0, events=events)
    await drive(recipe, engine, trainer, fake)
    assert events == (["generate"] * PROMPTS_PER_STEP + ["train", "refit"]) * 3
    assert all(m["rollout/max_lag"] == 0 for m in metrics(recipe))


async def test_lookahead_zero_colocated_order(tmp_path: Path, fake: FakeTime) -> None:
    events: list[str] = []
    recipe = make_recipe(tmp_path, steps=3, lookahead=0)
    engine = RecordingEngine(time=fake, latency=1.0, events=events)
    trainer = FakeTrainer(time=fake, latency=20.0, events=events)
    await drive(recipe, engine, trainer, fake)
    assert events == (["generate"] * PROMPTS_PER_STEP + ["stand_down", "train", "wake"]) * 3


# -- admission and backpressure --------------------------------------------------------------


async def test_slow_trainer_fills_no_channel_past_capacity_and_admission_blocks(
    tmp_path: Path, fake: FakeTime, channels: dict[str, Channel[Any]], tickets: list[TicketBox]
) -> None:
    lookahead = 2
    waiting_for_tickets: list[int] = []
    outstanding: list[int] = []

    def on_step(version: int, groups: Sequence[TrainGroup]) -> None:
        (box,) = tickets
        waiting_for_tickets.append(box.statistics().waiters)
        outstanding.append(box.statistics().outstanding)

    recipe = make_recipe(tmp_path, steps=5, lookahead=lookahead)
    engine = FakeEngine(time=fake, latency=1.0, blocks_training=False)
    trainer = FakeTrainer(time=fake, latency=50.0, on_step=on_step)
    await drive(recipe, engine, trainer, fake)
    assert set(channels) == {"batches", "generated", "scored"}
    for channel in channels.values():
        stats = channel.statistics()
        assert stats.peak_depth <= stats.capacity, stats
        assert stats.closed and stats.depth == 0
    # While step k trains, the next L batches are generated and scored and wait in front of it:
    # one more admitted batch (a leaked ticket) would show as a deeper queue.
    assert channels["scored"].statistics().peak_depth == lookahead * PROMPTS_PER_STEP
    # The prompt stage (the producer at the head) is held back by admission, never by memory.
    assert max(waiting_for_tickets) == 1
    assert max(outstanding) == lookahead + 1


async def test_a_full_channel_blocks_the_rollout_producer(fake: FakeTime, tmp_path: Path) -> None:
    from pipeline.clock import DeadlineClock
    from pipeline.contracts.messages import Prompt
    from pipeline.gate import EngineGate
    from pipeline.metrics import MetricsLog
    from pipeline.trace import Trace
    from pipeline.watchdog import Watchdog
    from stages.context import RunContext
    from stages.rollout import RolloutSection, RolloutStage
    from stages.timings import BatchTimings

    clock = DeadlineClock(source=fake)
    inp: Channel[Batch] = Channel("batches", 1)
    out: Channel[Any] = Channel("generated", 1)
    engine = FakeEngine(time=fake)
    context = RunContext(
        clock=clock,
        trace=Trace(fake.now),
        watchdog=Watchdog(fake, stall_s=1e9, fail=False),
        timings=BatchTimings(),
        metrics=MetricsLog(tmp_path),
    )
    stage = RolloutStage(
        RolloutSection(samples_per_prompt=2),
        gate=EngineGate(engine, clock),
        inp=inp,
        out=out,
        context=context,
    )
    prompts = tuple(Prompt(prompt_id=f"p{i}", text="1=", tokens=(3, 12)) for i in range(4))
    async with anyio.create_task_group() as tg:
        tg.start_soon(clock.run)
        tg.start_soon(stage.run)
        await inp.send(Batch(batch=0, prompts=prompts))
        await anyio.wait_all_tasks_blocked()
        stats = out.statistics()
        assert (stats.depth, stats.peak_depth, stats.waiting_senders) == (1, 1, 3)
        assert engine.calls == 4
        inp.close()
        received = [await out.receive() for _ in range(4)]
        tg.cancel_scope.cancel()
    context.metrics.close()
    assert sorted(g.prompt.prompt_id for g in received) == ["p0", "p1", "p2", "p3"]


# -- every admitted prompt is accounted for ---------------------------------------------------


async def test_every_admitted_prompt_ends_trained_dropped_or_poisoned(
    tmp_path: Path, fake: FakeTime, channels: dict[str, Channel[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    admitted: list[str] = []
    dropped: list[Dropped] = []
    scored: dict[str, Group] = {}
    original_send = Channel.send

    async def spy(self: Channel[Any], item: Any) -> None:
        if self.name == "batches":
            admitted.extend(p.prompt_id for p in item.prompts)
        if self.name == "scored":
            if isinstance(item, Dropped):
                dropped.append(item)
            else:
                scored[item.group_id] = item
        await original_send(self, item)

    monkeypatch.setattr(Channel, "send", spy)
    recipe = make_recipe(
        tmp_path,
        steps=6,
        rollout={"samples_per_prompt": 2, "max_retries": 0, "generation_s": 10.0},
    )
    engine = FakeEngine(
        time=fake,
        latency=lambda call: 30.0 if call == 7 else 1.0,  # call 7 times out
        crash_calls=[1, 4],
        nonfinite_calls=[2, 9],
        blocks_training=False,
    )
    trainer = FakeTrainer(time=fake, latency=5.0)
    summary = await drive(recipe, engine, trainer, fake)
    trained = {scored[g.group_id].prompt.prompt_id for step in trainer.steps for g in step}
    dropped_ids = {d.prompt_id for d in dropped}
    assert sorted(d.reason.split(":")[0] for d in dropped) == [
        "engine_error",
        "engine_error",
        "generation_timeout",
    ]
    assert all(d.reason for d in dropped)
    poisoned = set(admitted) - trained - dropped_ids
    assert len(poisoned) == 2  # each nonfinite call poisons a whole group: counted, never trained
    assert trained.isdisjoint(dropped_ids)
    assert len(admitted) == len(set(admitted))
    assert all(math.isfinite(sum(s.logprobs)) for step in trainer.steps for g in step for s in g.samples)
    lines = metrics(recipe)
    assert sum(m["rollout/dropped_groups"] for m in lines) == 3 == summary.dropped_groups
    assert sum(m["rollout/poisoned_samples"] for m in lines) == 2 * 2
    assert lines[-1]["rollout/poisoned_samples_total"] == 2 * 2  # the rollout's own count
    assert lines[-1]["rollout/timeouts"] == 1
    assert summary.steps_done == 6


async def test_a_rejected_request_is_dropped_without_retries(tmp_path: Path, fake: FakeTime) -> None:
    recipe = make_recipe(tmp_path, steps=2, rollout={"samples_per_prompt": 2, "max_retries": 3})
    engine = FakeEngine(time=fake, latency=1.0, reject_calls=[0], crash_calls=[1])
    trainer = FakeTrainer(time=fake, latency=5.0)
    summary = await drive(recipe, engine, trainer, fake)
    lines = metrics(recipe)
    assert summary.dropped_groups == 1 and summary.steps_done == 2
    # The crashed call is retried (once, successfully); the rejected one is not.
    assert lines[-1]["rollout/retries"] == 1
    assert lines[-1]["rollout/engine_errors"] == 2


async def test_drop_budget_exceeded_stops_the_run(tmp_path: Path, fake: FakeTime) -> None:
    recipe = make_recipe(
        tmp_path, steps=4, rollout={"samples_per_prompt": 2, "max_retries": 0, "max_dropped_groups": 1}
    )
    engine = FakeEngine(time=fake, latency=1.0, crash_calls=[0, 1, 2, 3])
    trainer = FakeTrainer(time=fake, latency=5.0)
    with pytest.raises(DropBudgetExceeded) as raised:
        await drive(recipe, engine, trainer, fake)
    assert str(raised.value) == (
        "2 groups dropped, over rollout.max_dropped_groups=1; "
        "last reason: engine_error: EngineCrash: fake engine crashed on call 1"
    )
    assert trainer.steps == []


# -- deadlines and the gate -------------------------------------------------------------------


@pytest.mark.parametrize(("latency", "timeouts"), [(1.0, 0), (6.0, 1)])
async def test_time_stood_down_is_not_charged_to_rollout_deadlines(
    tmp_path: Path, fake: FakeTime, latency: float, timeouts: int
) -> None:
    # The trainer takes 100 s per step with the engine stood down; generation waits at the gate
    # for most of it. Deadlines of 5-20 s fire only for a request that truly takes too long.
    recipe = make_recipe(
        tmp_path,
        steps=4,
        lookahead=1,
        rollout={
            "samples_per_prompt": 2,
            "generation_s": 5.0,
            "sample_s": 8.0,
            "batch_s": 20.0,
            "max_retries": 0,
        },
    )
    engine = FakeEngine(time=fake, latency=lambda call: latency if call == 5 else 1.0)
    trainer = FakeTrainer(time=fake, latency=100.0)
    summary = await drive(recipe, engine, trainer, fake)
    assert summary.steps_done == 4
    assert fake.now() > 400
    assert metrics(recipe)[-1]["rollout/timeouts"] == timeouts
    assert summary.dropped_groups == timeouts


# -- failures ---------------------------------------------------------------------------------


async def test_a_failing_stage_cancels_the_rest_and_its_error_reaches_the_caller(
    tmp_path: Path, fake: FakeTime
) -> None:
    injector = FaultInjector("train", 2)
    recipe = make_recipe(tmp_path, steps=10, lookahead=2)
    engine = FakeEngine(time=fake, latency=1.0, blocks_training=False)
    trainer = FakeTrainer(time=fake, latency=5.0, on_step=lambda step, _: injector.check("train", step))
    before = asyncio.all_tasks()
    with pytest.raises(StageFailed) as raised:
        await drive(recipe, engine, trainer, fake)
    assert (
        str(raised.value) == "stage 'train' failed: InjectedFault: injected fault in stage 'train' at step 2"
    )
    assert isinstance(raised.value.error, InjectedFault)
    assert raised.value.stage == "train"
    assert len(trainer.steps) == 2
    assert asyncio.all_tasks() == before
    assert len(metrics(recipe)) == 2


# -- what a run leaves behind -----------------------------------------------------------------


async def test_metrics_have_the_documented_keys_and_no_nan(tmp_path: Path, fake: FakeTime) -> None:
    recipe = make_recipe(tmp_path, steps=3)
    engine = FakeEngine(time=fake, latency=1.0, nonfinite_calls=[0])
    trainer = FakeTrainer(time=fake, latency=5.0)
    await drive(recipe, engine, trainer, fake)
    lines = metrics(recipe)
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert [m["policy_version"] for m in lines] == [1, 2, 3]
    for line in lines:
        assert METRIC_KEYS <= set(line), METRIC_KEYS - set(line)
        assert all(math.isfinite(v) for v in line.values() if isinstance(v, float))
    assert lines[0]["rollout/poisoned_samples"] == 2
    run_dir = Path(recipe.run.dir)
    assert (run_dir / "recipe.yaml").is_file()
    trace = json.loads((run_dir / "trace.json").read_text())
    names = [e["name"] for e in trace["traceEvents"]]
    assert names.count("stand_down") == names.count("wake") == 3


# -- runs that train nothing -------------------------------------------------------------------


def nan_for_odd_prompts(prompt: Any, completion: str) -> float:
    """A reward function (`test_flow:nan_for_odd_prompts`): NaN for every odd-numbered prompt."""
    return math.nan if int(prompt.prompt_id.split("-")[1]) % 2 else 1.0


async def test_a_non_finite_reward_is_a_counted_failure_and_never_trained(
    tmp_path: Path, fake: FakeTime, scored: dict[str, Group]
) -> None:
    recipe = make_recipe(tmp_path, steps=3, reward={"function": "test_flow:nan_for_odd_prompts"})
    trainer = FakeTrainer(time=fake, latency=5.0)
    summary = await drive(recipe, FakeEngine(time=fake, latency=1.0), trainer, fake)
    assert summary.steps_done == 3
    trained = {scored[g.group_id].prompt.prompt_id for step in trainer.steps for g in step}
    assert trained == {"train-0", "train-2", "train-4"}
    assert all(s.reward == 1.0 for step in trainer.steps for g in step for s in g.samples)
    lines = metrics(recipe)
    assert [m["reward/mean"] for m in lines] == [1.0, 1.0, 1.0]
    assert lines[-1]["reward/failures"] == 3 * 2  # one prompt a step, two samples each


async def test_non_finite_rewards_over_the_budget_stop_the_run(tmp_path: Path, fake: FakeTime) -> None:
    recipe = make_recipe(
        tmp_path,
        steps=3,
        reward={"function": "test_flow:nan_for_odd_prompts", "reward_s": 1.0e9, "max_failures": 1},
    )
    with pytest.raises(DropBudgetExceeded) as raised:
        await drive(recipe, FakeEngine(time=fake, latency=1.0), FakeTrainer(time=fake), fake)
    assert str(raised.value) == (
        "2 reward failures, over reward.max_failures=1; last: NonFiniteReward: "
        "reward function returned non-finite values: {'reward': nan}"
    )


def always_half(prompt: Any, completion: str) -> float:
    """A reward function (`test_flow:always_half`) that cannot tell answers apart."""
    return 0.5


def first_character(prompt: Any, completion: str) -> float:
    """A reward function (`test_flow:first_character`): the FakeEngine's samples of a group
    differ in their tokens, so their rewards differ."""
    return float(ord(completion[0])) if completion else 0.0


async def test_a_run_whose_groups_all_have_equal_rewards_says_so_once(
    tmp_path: Path, fake: FakeTime, caplog: pytest.LogCaptureFixture
) -> None:
    recipe = make_recipe(tmp_path, steps=FLAT_STEPS_WARNING + 2, reward={"function": "test_flow:always_half"})
    await drive(recipe, FakeEngine(time=fake, latency=1.0), FakeTrainer(time=fake), fake)
    warned = [r.getMessage() for r in caplog.records if r.name == "stages.step_record"]
    assert warned == [
        f"steps 1-{FLAT_STEPS_WARNING} learned nothing: in every group all samples got the same reward, "
        "so every advantage was 0 (train/loss 0). Check that reward.function scores different answers "
        "differently (a constant, or a parse that always fails?) and that samples differ "
        "(rollout.temperature > 0, rollout.samples_per_prompt > 1); reward/flat_groups counts such "
        "groups each step"
    ]
    assert [m["reward/flat_groups"] for m in metrics(recipe)] == [PROMPTS_PER_STEP] * (FLAT_STEPS_WARNING + 2)


async def test_groups_whose_rewards_differ_raise_no_warning(
    tmp_path: Path, fake: FakeTime, caplog: pytest.LogCaptureFixture
) -> None:
    recipe = make_recipe(
        tmp_path, steps=FLAT_STEPS_WARNING + 2, reward={"function": "test_flow:first_character"}
    )
    await drive(recipe, FakeEngine(time=fake, latency=1.0), FakeTrainer(time=fake), fake)
    assert [r.getMessage() for r in caplog.records if r.name == "stages.step_record"] == []
    assert {m["reward/flat_groups"] for m in metrics(recipe)} == {0}


def cancels_on_train_6(prompt: Any, completion: str) -> float:
    """`test_flow:cancels_on_train_6`: raises CancelledError itself (nothing cancelled it)."""
    if prompt.prompt_id == "train-6":
        raise asyncio.CancelledError()
    return 1.0


async def async_cancels_on_train_6(prompt: Any, completion: str) -> float:
    return cancels_on_train_6(prompt, completion)


def interrupts_on_train_6(prompt: Any, completion: str) -> float:
    """`test_flow:interrupts_on_train_6`: raises KeyboardInterrupt on one prompt."""
    if prompt.prompt_id == "train-6":
        raise KeyboardInterrupt
    return 1.0


@pytest.mark.parametrize("function", ["cancels_on_train_6", "async_cancels_on_train_6"])
async def test_a_reward_raising_cancelled_error_is_a_counted_failure_not_the_end_of_the_run(
    tmp_path: Path, fake: FakeTime, function: str
) -> None:
    recipe = make_recipe(tmp_path, steps=6, reward={"function": f"test_flow:{function}"})
    summary = await drive(
        recipe, FakeEngine(time=fake, latency=1.0), FakeTrainer(time=fake, latency=5.0), fake
    )
    assert (summary.steps_done, summary.stopped) == (6, False)
    assert metrics(recipe)[-1]["reward/failures"] == 2  # the prompt's two samples


async def test_a_reward_raising_keyboard_interrupt_stops_the_run_with_one_line_and_saves(
    tmp_path: Path, fake: FakeTime
) -> None:
    from pipeline.rewards.scoring import RewardAborted
    from stages.checkpoint import committed

    recipe = make_recipe(tmp_path, steps=6, reward={"function": "test_flow:interrupts_on_train_6"})
    with pytest.raises(RewardAborted) as raised:
        await drive(recipe, FakeEngine(time=fake, latency=1.0), FakeTrainer(time=fake, latency=5.0), fake)
    assert str(raised.value) == (
        "reward.function: interrupts_on_train_6 raised KeyboardInterrupt; a reward function returns a "
        "float or raises an Exception (a counted failure): the run stops"
    )
    steps = len(metrics(recipe))
    assert steps >= 1
    saved = committed(Path(recipe.run.dir) / "checkpoints")
    assert [p.name for p in saved] == [f"step-{steps:06d}"]


async def test_batches_with_nothing_to_train_on_stop_the_run(tmp_path: Path, fake: FakeTime) -> None:
    recipe = make_recipe(tmp_path, steps=3, train={"max_consecutive_empty_batches": 2})
    engine = FakeEngine(time=fake, latency=1.0, nonfinite_calls=range(1000))  # every sample poisoned
    trainer = FakeTrainer(time=fake)
    with pytest.raises(NothingTrained) as raised:
        await drive(recipe, engine, trainer, fake)
    assert str(raised.value) == (
        "3 batches in a row had nothing to train on (the last: 0 groups dropped, 4 samples poisoned, "
        "0 unscored), over train.max_consecutive_empty_batches=2"
    )
    assert trainer.steps == []


async def test_a_trained_batch_resets_the_count_of_empty_ones(tmp_path: Path, fake: FakeTime) -> None:
    recipe = make_recipe(tmp_path, steps=3, lookahead=0, train={"max_consecutive_empty_batches": 2})
    # Batches 0-1 and 3-4 are empty (two calls a batch), batches 2, 5 and 6 train.
    engine = FakeEngine(time=fake, latency=1.0, nonfinite_calls=[0, 1, 2, 3, 6, 7, 8, 9])
    summary = await drive(recipe, engine, FakeTrainer(time=fake), fake)
    assert summary.steps_done == 3
    assert metrics(recipe)[-1]["train/empty_batches"] == 4


async def test_steps_that_apply_no_update_stop_the_run(tmp_path: Path, fake: FakeTime) -> None:
    recipe = make_recipe(tmp_path, steps=10, train={"max_consecutive_skipped_steps": 2})
    trainer = FakeTrainer(time=fake, skipped_steps=[0, 2, 3, 4, 5])
    with pytest.raises(NothingTrained) as raised:
        await drive(recipe, FakeEngine(time=fake, latency=1.0), trainer, fake)
    assert str(raised.value) == (
        "3 train steps in a row (up to step 5) skipped their optimizer update "
        "(non-finite loss or gradient norm), over train.max_consecutive_skipped_steps=2"
    )
    assert [m["step"] for m in metrics(recipe)] == [1, 2, 3, 4, 5]


async def test_a_run_whose_every_step_skipped_its_update_fails(tmp_path: Path, fake: FakeTime) -> None:
    recipe = make_recipe(tmp_path, steps=2)
    trainer = FakeTrainer(time=fake, skipped_steps=[0, 1])
    with pytest.raises(NothingTrained) as raised:
        await drive(recipe, FakeEngine(time=fake, latency=1.0), trainer, fake)
    assert str(raised.value) == (
        "all 2 train steps of this run skipped their optimizer update "
        "(non-finite loss or gradient norm): nothing was trained"
    )


# -- engine errors: infrastructure failures are retried, bugs fail the run ---------------------


async def test_an_engine_bug_fails_the_run_at_once(tmp_path: Path, fake: FakeTime) -> None:
    recipe = make_recipe(tmp_path, steps=4, lookahead=0, rollout={"samples_per_prompt": 2, "max_retries": 3})
    engine = FakeEngine(time=fake, latency=1.0, errors={2: RuntimeError("index out of range in the sampler")})
    trainer = FakeTrainer(time=fake, latency=5.0)
    with pytest.raises(StageFailed) as raised:
        await drive(recipe, engine, trainer, fake)
    assert str(raised.value) == "stage 'rollout' failed: RuntimeError: index out of range in the sampler"
    assert engine.calls == 4  # batch 0, then batch 1's two requests: the failed one is not retried
    assert len(trainer.steps) == 1


async def test_injected_engine_crashes_are_retried(tmp_path: Path, fake: FakeTime) -> None:
    recipe = make_recipe(
        tmp_path,
        steps=4,
        rollout={"samples_per_prompt": 2, "max_retries": 4, "backoff_s": 0.1},
        faults={"engine_crash_rate": 0.4},
    )
    summary = await drive(recipe, FakeEngine(time=fake, latency=1.0), FakeTrainer(time=fake), fake)
    last = metrics(recipe)[-1]
    assert summary.steps_done == 4
    assert last["rollout/engine_errors"] > 0
    assert last["rollout/retries"] >= last["rollout/engine_errors"] - last["rollout/dropped_groups_total"]


def eval_recipe(tmp_path: Path, **sections: Any) -> Recipe:
    return make_recipe(
        tmp_path,
        steps=2,
        eval={"every_steps": 2, "num_prompts": 1},
        rollout={"samples_per_prompt": 2, "max_retries": 1, "backoff_s": 0.1},
        **sections,
    )


def evals(recipe: Recipe) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (Path(recipe.run.dir) / "eval.jsonl").read_text().splitlines()]


async def test_an_engine_crash_in_an_evaluation_is_retried(tmp_path: Path, fake: FakeTime) -> None:
    recipe = eval_recipe(tmp_path)
    engine = FakeEngine(time=fake, latency=1.0, greedy_errors=[EngineCrash("worker lost")])
    summary = await drive(recipe, engine, FakeTrainer(time=fake), fake)
    assert summary.steps_done == 2
    assert [e["step"] for e in evals(recipe)] == [0, 2]


async def test_an_evaluation_whose_retries_run_out_is_skipped_and_said(
    tmp_path: Path, fake: FakeTime, caplog: pytest.LogCaptureFixture
) -> None:
    recipe = eval_recipe(tmp_path)
    engine = FakeEngine(time=fake, latency=1.0, greedy_errors=[EngineCrash("worker lost")] * 2)
    summary = await drive(recipe, engine, FakeTrainer(time=fake), fake)
    assert summary.steps_done == 2
    assert [e["step"] for e in evals(recipe)] == [2]
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert skipped == [
        "evaluation at step 0 skipped: generation for heldout-0: engine_error: EngineCrash: worker lost"
    ]
    assert metrics(recipe)[-1]["eval/skipped"] == 1


async def test_an_engine_bug_in_an_evaluation_fails_the_run(tmp_path: Path, fake: FakeTime) -> None:
    recipe = eval_recipe(tmp_path)
    engine = FakeEngine(time=fake, latency=1.0, greedy_errors=[TypeError("greedy got a tensor")])
    with pytest.raises(StageFailed) as raised:
        await drive(recipe, engine, FakeTrainer(time=fake), fake)
    assert str(raised.value) == "stage 'train' failed: TypeError: greedy got a tensor"


def slow_on_heldout(prompt: Any, completion: str) -> float:
    """`test_flow:slow_on_heldout`: hangs (for a minute of real time) on held-out prompts."""
    import time

    if prompt.prompt_id.startswith("heldout"):
        time.sleep(60)
    return 1.0


async def test_an_evaluation_whose_scoring_hangs_is_skipped_at_its_deadline(
    tmp_path: Path, fake: FakeTime, caplog: pytest.LogCaptureFixture
) -> None:
    recipe = eval_recipe(tmp_path, reward={"function": "test_flow:slow_on_heldout", "reward_s": 30.0})
    summary = await drive(recipe, FakeEngine(time=fake, latency=1.0), FakeTrainer(time=fake), fake)
    assert summary.steps_done == 2
    assert not (Path(recipe.run.dir) / "eval.jsonl").read_text()
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert skipped == [
        f"evaluation at step {step} skipped: evaluation scoring exceeded its deadline of 30 s "
        "(reward.reward_s for each 2 answers)"
        for step in (0, 2)
    ]


# -- partial rollouts ------------------------------------------------------------------------


def partial_recipe(tmp_path: Path, **sections: Any) -> Recipe:
    return make_recipe(tmp_path, steps=5, lookahead=1, **merge({"rollout": {"partial": True}}, sections))


def partial_engine(fake: FakeTime) -> FakeEngine:
    """Odd batches' requests (calls 2-3, 6-7, ...) take 40 s, even ones 8 s: at L = 1 the first
    step (batch 0, 20 s) stands down while batch 1 is in flight, one token into its four."""
    return FakeEngine(
        time=fake, latency=lambda call: 40.0 if call // 2 % 2 else 8.0, response_len=4, partial_rollouts=True
    )


def recording(trained: list[tuple[int, list[Sample]]], scored: dict[str, Group]) -> Any:
    """A FakeTrainer's `on_step` that keeps, for each step, the samples its groups came from."""

    def on_step(version: int, groups: Sequence[TrainGroup]) -> None:
        trained.append((version, [s for g in groups for s in scored[g.group_id].samples if s.usable]))

    return on_step


async def test_partial_rollouts_freeze_in_flight_requests_and_keep_each_tokens_version(
    tmp_path: Path, fake: FakeTime, scored: dict[str, Group]
) -> None:
    """Colocated at L = 1: the stand-down freezes the next batch's requests instead of waiting
    for them; they finish after the wake, their first stretch still tagged (version and
    behaviour logprob) with the weights that made it, and the lag counts their first version."""
    trained: list[tuple[int, list[Sample]]] = []
    recipe = partial_recipe(tmp_path)
    engine = partial_engine(fake)
    trainer = FakeTrainer(time=fake, latency=20.0, on_step=recording(trained, scored))
    summary = await drive(recipe, engine, trainer, fake)
    assert summary.steps_done == 5
    assert engine.frozen > 0
    continued = [s for _, samples in trained for s in samples if len(s.versions) > 1]
    assert continued
    for sample in continued:  # a token of version 0, then three of version 1 after the wake
        assert sample.versions == ((0, 0), (1, 1))
        assert sample.logprobs == (-1.0, -2.0, -2.0, -2.0)  # the fake's: -1 - its wakes then
    for version, samples in trained:
        for sample in samples:
            assert sample.gen_version == (sample.versions[0][1], sample.versions[-1][1])
            assert 0 <= version - sample.gen_version[0] <= 1
    lines = metrics(recipe)
    assert max(m["rollout/max_lag"] for m in lines) == 1
    assert sum(m["rollout/partial_samples"] for m in lines) == len(continued)
    assert all(m["rollout/reprefilled_tokens"] > 0 for m in lines if m["rollout/partial_samples"])
    trace = json.loads((tmp_path / "run" / "trace.json").read_text())
    tracks = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    frozen = [e for e in trace["traceEvents"] if e["name"] == "frozen"]
    assert frozen and all(tracks[e["tid"]].startswith("rollout ") for e in frozen)
    assert all(e["dur"] >= 20e6 for e in frozen)  # the whole stand-down, train and wake


async def test_a_request_frozen_when_a_stop_cuts_the_drain_is_generated_again_after_the_resume(
    tmp_path: Path, fake: FakeTime, scored: dict[str, Group]
) -> None:
    """A frozen request is never saved: a stop during step 1 (batch 1 frozen) whose grace ends
    before batch 1 finishes leaves the checkpoint of step 1 (next batch 1); the resumed run
    draws batch 1's prompts again and generates them whole under its own weights. Every prompt
    is trained exactly once across both runs."""
    from pipeline.runner import StopRequest

    recipe = partial_recipe(tmp_path, run={"steps": 4, "stop_grace_s": 1.0}, checkpoint={"every_steps": 1})
    stop = StopRequest()
    trained: list[tuple[int, list[Sample]]] = []
    engine = partial_engine(fake)
    frozen_at_stop: list[int] = []
    record = recording(trained, scored)

    def on_step(version: int, groups: Sequence[TrainGroup]) -> None:
        record(version, groups)
        if version == 0:  # step 1, while the engine is down with batch 1 frozen
            frozen_at_stop.append(engine.frozen)
            stop.request("test stop")

    summary = await drive(
        recipe, engine, FakeTrainer(time=fake, latency=20.0, on_step=on_step), fake, stop=stop
    )
    assert summary.stopped and summary.steps_done == 1
    assert frozen_at_stop == [PROMPTS_PER_STEP]
    trainer = FakeTrainer(time=fake, latency=20.0, on_step=recording(trained, scored))
    summary = await drive(recipe, partial_engine(fake), trainer, fake)
    assert summary.steps_done == 4
    assert [version for version, _ in trained] == [0, 1, 2, 3]
    prompts = [s.prompt_id for _, samples in trained for s in samples if s.sample_index == 0]
    assert sorted(prompts) == sorted(set(prompts)) and len(prompts) == 4 * PROMPTS_PER_STEP
    batch_1 = trained[1][1]
    assert {s.target_step for s in batch_1} == {1}
    assert all(s.versions == ((0, 1),) and s.reprefilled_tokens == 0 for s in batch_1)
