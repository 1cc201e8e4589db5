"""The engine gate: capability-driven step order, serving while down, clock suspension, timings."""

from __future__ import annotations

import anyio
import pytest

from pipeline.clock import DeadlineClock
from pipeline.gate import EngineGate, GateState
from pipeline.testing import FakeEngine, FakeTime


class ClockWatchingEngine(FakeEngine):
    """Records, with each transition, whether the deadline clock was suspended at that moment."""

    def __init__(self, clock: DeadlineClock, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.clock = clock

    async def stand_down(self) -> None:
        await super().stand_down()
        self.events[-1] += f" suspended={self.clock.suspended}"

    async def wake(self) -> None:
        await super().wake()
        self.events[-1] += f" suspended={self.clock.suspended}"

    async def refit(self) -> None:
        await super().refit()
        self.events[-1] += f" suspended={self.clock.suspended}"


def make_gate(fake: FakeTime, events: list[str], **capabilities: bool) -> tuple[EngineGate, DeadlineClock]:
    clock = DeadlineClock(source=fake)
    engine = FakeEngine(time=fake, events=events, **capabilities)
    return EngineGate(engine, clock), clock


def recorder(events: list[str], name: str, clock: DeadlineClock | None = None):
    async def step() -> str:
        events.append(name if clock is None else f"{name} suspended={clock.suspended}")
        return name

    return step


@pytest.mark.parametrize(
    ("capabilities", "order"),
    [
        pytest.param(
            {"blocks_training": True, "wake_carries_weights": True},
            ["stand_down", "train", "save", "wake"],
            id="colocated",
        ),
        pytest.param(
            {"blocks_training": True, "wake_carries_weights": False},
            ["stand_down", "train", "save", "refit", "wake"],
            id="blocking-refit",
        ),
        pytest.param(
            {"blocks_training": False, "wake_carries_weights": False},
            ["train", "refit", "save"],
            id="separate",
        ),
        pytest.param(
            {"blocks_training": False, "wake_carries_weights": True},
            ["train", "refit", "save"],
            id="separate-wake-carries",
        ),
    ],
)
async def test_step_order_follows_capabilities(capabilities: dict[str, bool], order: list[str]) -> None:
    events: list[str] = []
    gate, _ = make_gate(FakeTime(), events, **capabilities)
    result, timings = await gate.step(recorder(events, "train"), save=recorder(events, "save"))
    assert result == "train"
    assert events == order
    assert set(timings) == ({"stand_down"} if capabilities["blocks_training"] else set()) | set(order) - {
        "stand_down"
    }
    assert gate.state is GateState.SERVING


async def test_step_without_save_skips_it() -> None:
    events: list[str] = []
    gate, _ = make_gate(FakeTime(), events)
    await gate.step(recorder(events, "train"))
    assert events == ["stand_down", "train", "wake"]


@pytest.mark.parametrize("wake_carries_weights", [True, False])
async def test_clock_is_suspended_exactly_during_the_stand_down_window(wake_carries_weights: bool) -> None:
    fake = FakeTime()
    events: list[str] = []
    clock = DeadlineClock(source=fake)
    engine = ClockWatchingEngine(clock, events=events, wake_carries_weights=wake_carries_weights)
    gate = EngineGate(engine, clock)
    assert not clock.suspended
    await gate.step(recorder(events, "train", clock), save=recorder(events, "save", clock))
    assert not clock.suspended
    expected = ["stand_down suspended=True", "train suspended=True", "save suspended=True"]
    if not wake_carries_weights:
        expected.append("refit suspended=True")
    assert events == [*expected, "wake suspended=True"]
    assert clock.statistics().suspend_depth == 0


async def test_non_blocking_engine_never_suspends_the_clock() -> None:
    fake = FakeTime()
    events: list[str] = []
    clock = DeadlineClock(source=fake)
    engine = ClockWatchingEngine(clock, events=events, blocks_training=False)
    gate = EngineGate(engine, clock)
    await gate.step(recorder(events, "train", clock), save=recorder(events, "save", clock))
    assert events == ["train suspended=False", "refit suspended=False", "save suspended=False"]


async def test_serving_waits_while_the_engine_is_down() -> None:
    events: list[str] = []
    gate, _ = make_gate(FakeTime(), events)
    training = anyio.Event()
    release = anyio.Event()

    async def train() -> None:
        training.set()
        events.append("train")
        await release.wait()

    async def generate() -> None:
        await training.wait()
        async with gate.serving() as version:
            events.append(f"generate v{version}")

    async with anyio.create_task_group() as tg:
        tg.start_soon(generate)
        tg.start_soon(gate.step, train)
        await anyio.wait_all_tasks_blocked()
        assert gate.state is GateState.DOWN
        assert gate.statistics().waiting == 1
        assert events == ["stand_down", "train"]
        release.set()
    assert events == ["stand_down", "train", "wake", "generate v1"]


async def test_stand_down_waits_for_in_flight_calls() -> None:
    fake = FakeTime()
    events: list[str] = []
    gate, _ = make_gate(fake, events)
    finish_call = anyio.Event()
    in_call = anyio.Event()

    async def generate() -> None:
        async with gate.serving():
            in_call.set()
            await finish_call.wait()
            fake.advance(3)  # the call takes 3 s to finish after the step asked for the engine
            events.append("call done")

    async def late_generate() -> None:
        async with gate.serving() as version:
            events.append(f"late call v{version}")

    async with anyio.create_task_group() as tg:
        tg.start_soon(generate)
        await in_call.wait()
        tg.start_soon(gate.step, recorder(events, "train"))
        await anyio.wait_all_tasks_blocked()
        assert gate.state is GateState.STANDING_DOWN
        assert gate.statistics().in_flight == 1
        tg.start_soon(late_generate)  # a new call is not admitted while standing down
        await anyio.wait_all_tasks_blocked()
        assert events == []
        finish_call.set()
    assert events == ["call done", "stand_down", "train", "wake", "late call v1"]
    assert gate.statistics().last_timings["stand_down"] == 3


async def test_timings_statistics_and_versions_are_recorded() -> None:
    fake = FakeTime()
    events: list[str] = []
    transitions: list[tuple[str, float, float]] = []
    clock = DeadlineClock(source=fake)
    engine = FakeEngine(time=fake, events=events, wake_carries_weights=False)
    gate = EngineGate(engine, clock, version=4, on_transition=lambda *t: transitions.append(t))

    async def train() -> None:
        fake.advance(5)

    async def save() -> None:
        fake.advance(2)

    _, timings = await gate.step(train, save=save)
    assert timings == {"stand_down": 0, "train": 5, "save": 2, "refit": 0, "wake": 0}
    assert transitions == [
        ("stand_down", 0, 0),
        ("train", 0, 5),
        ("save", 5, 7),
        ("refit", 7, 7),
        ("wake", 7, 7),
    ]
    stats = gate.statistics()
    assert (stats.state, stats.engine_version, stats.steps, stats.in_flight, stats.waiting) == (
        "serving",
        5,
        1,
        0,
        0,
    )
    assert stats.last_timings == timings
    assert stats.engine_memory_after_stand_down == 0  # FakeEngine reports 0 bytes while down
    await gate.step(train)
    assert gate.engine_version == 6
    async with gate.serving() as version:
        assert version == 6


async def test_failed_train_step_still_wakes_and_resumes_the_clock() -> None:
    events: list[str] = []
    gate, clock = make_gate(FakeTime(), events)

    async def train() -> None:
        events.append("train")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        await gate.step(train, save=recorder(events, "save"))
    assert events == ["stand_down", "train", "wake"]
    assert not clock.suspended
    assert gate.state is GateState.SERVING
    assert gate.engine_version == 0


async def test_version_is_published_only_after_refit() -> None:
    # A non-blocking engine keeps serving during the refit: a call starting then is served the old
    # weights (or waits for the refit inside the backend), so it must not be tagged with the new version.
    events: list[str] = []
    fake = FakeTime()
    seen: list[int] = []

    class SlowRefitEngine(FakeEngine):
        async def refit(self) -> None:
            async with gate.serving() as version:
                seen.append(version)
            await super().refit()

    gate = EngineGate(
        SlowRefitEngine(time=fake, events=events, blocks_training=False), DeadlineClock(source=fake)
    )
    await gate.step(recorder(events, "train"))
    assert seen == [0]
    assert gate.engine_version == 1


@pytest.mark.parametrize("blocks_training", [True, False], ids=["wake", "refit"])
async def test_handoff_check_stops_a_step_whose_engine_serves_other_weights(blocks_training: bool) -> None:
    """After the wake (colocated) or the refit (separate) the engine's fingerprint must equal
    the trainer's; a tensor that differs (or that one side lacks) fails the step, named, and the
    gate still reopens. Matching fingerprints pass; without `checks` nothing is compared."""
    from pipeline.contracts.errors import HandoffMismatch
    from pipeline.testing import FakeTrainer

    fake = FakeTime()
    engine = FakeEngine(time=fake, blocks_training=blocks_training, wake_carries_weights=blocks_training)
    trainer = FakeTrainer()
    gate = EngineGate(engine, DeadlineClock(source=fake), checks=trainer)
    trainer.published = {"embed": 1, "layers.0.q": 2, "layers.1.q": 3}
    engine.served = dict(trainer.published)
    await gate.step(recorder([], "train"))
    engine.served["layers.0.q"] = 7
    after = "wake" if blocks_training else "refit"
    message = (
        f"after the {after} to version 2 the engine serves weights other than the trainer's: "
        "layers.0.q differs; its copy is stale or corrupted"
    )
    with pytest.raises(HandoffMismatch) as raised:
        await gate.step(recorder([], "train"))
    assert str(raised.value) == message
    assert gate.state is GateState.SERVING
    del engine.served["layers.1.q"]
    with pytest.raises(HandoffMismatch, match=r"layers.0.q \(and 1 more\) differs"):
        await gate.step(recorder([], "train"))
    unchecked = EngineGate(engine, DeadlineClock(source=fake))
    await unchecked.step(recorder([], "train"))


async def test_handoff_check_stops_an_engine_that_keeps_memory_after_standing_down() -> None:
    from pipeline.contracts.errors import HandoffMismatch
    from pipeline.testing import FakeTrainer

    fake = FakeTime()
    engine = FakeEngine(time=fake)
    gate = EngineGate(engine, DeadlineClock(source=fake), checks=FakeTrainer())
    await gate.step(recorder([], "train"))
    engine.held_when_down = 4096
    with pytest.raises(HandoffMismatch) as raised:
        await gate.step(recorder([], "train"))
    assert str(raised.value) == "the engine still holds 4096 bytes after standing down (expected 0)"
    assert gate.state is GateState.SERVING and not engine.down


async def test_a_failed_train_step_is_not_hidden_behind_a_handoff_mismatch() -> None:
    """A step whose training raised published nothing new: the wake after it skips the weight
    check, so the training error is the one that surfaces."""
    from pipeline.testing import FakeTrainer

    fake = FakeTime()
    engine = FakeEngine(time=fake)
    trainer = FakeTrainer()
    trainer.published, engine.served = {"w": 1}, {"w": 2}  # as a half-applied update leaves them
    gate = EngineGate(engine, DeadlineClock(source=fake), checks=trainer)

    async def failing() -> None:
        raise RuntimeError("CUDA out of memory")

    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        await gate.step(failing)
    assert gate.state is GateState.SERVING and not engine.down


async def test_handoff_check_names_a_tensor_the_engine_serves_that_the_trainer_does_not() -> None:
    """An engine serving a tensor the trainer never published (another model's layout, a stale
    extra layer) fails the check too, naming it."""
    from pipeline.contracts.errors import HandoffMismatch
    from pipeline.testing import FakeTrainer

    fake = FakeTime()
    engine = FakeEngine(time=fake)
    trainer = FakeTrainer()
    gate = EngineGate(engine, DeadlineClock(source=fake), checks=trainer)
    trainer.published = {"embed": 1}
    engine.served = {"embed": 1, "layers.9.q": 5}
    with pytest.raises(HandoffMismatch) as raised:
        await gate.step(recorder([], "train"))
    assert str(raised.value) == (
        "after the wake to version 1 the engine serves weights other than the trainer's: "
        "layers.9.q differs; its copy is stale or corrupted"
    )


async def test_a_partial_engine_is_told_the_version_each_of_its_wakes_served() -> None:
    """A partial-rollout engine tags each stretch of a sequence with its count of wakes; the gate
    turns each count into the weights version served after that wake, and its frozen window."""
    fake = FakeTime()
    engine = FakeEngine(time=fake, partial_rollouts=True)
    gate = EngineGate(engine, DeadlineClock(source=fake), version=3)

    async def train() -> None:
        fake.advance(2)

    for _ in range(2):
        fake.advance(1)
        await gate.step(train)
    assert [gate.version_after(wakes) for wakes in (0, 1, 2)] == [3, 4, 5]
    assert [gate.frozen_window(wakes) for wakes in (1, 2)] == [(1, 3), (4, 6)]
