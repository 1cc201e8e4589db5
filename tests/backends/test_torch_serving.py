"""The torch engine: partial rollouts across a stand-down, and the bench lengths."""

from __future__ import annotations

import copy
import functools
import threading
from typing import Any

import anyio
import pytest
import torch

from backends.bench_lengths import LengthDraw
from backends.torch.config import ModelConfig
from backends.torch.engine import TorchEngine
from backends.torch.model import Decoder
from backends.torch.sampler import Sampler
from pipeline.clock import DeadlineClock
from pipeline.contracts.sections import BenchLengths
from pipeline.gate import EngineGate

PROMPT = [1, 2, 3, 4]


def _model() -> Decoder:
    torch.manual_seed(0)
    model = Decoder(ModelConfig(vocab_size=29, hidden_size=64, max_position_embeddings=64))
    with torch.no_grad():  # sharper, so greedy choices are not near-ties
        model.model.embed_tokens.weight.mul_(3)
    return model


def _engine(model: Decoder, *, compiled: bool | None = None, **options: Any) -> TorchEngine:
    """`compiled`: a bucketed sampler, as on a GPU (its loops narrow and widen)."""
    return TorchEngine(
        Sampler(model, compiled=compiled),
        shared=True,
        source=model,
        max_new_tokens=8,
        temperature=1.0,
        top_p=1.0,
        stop_token_ids=(),
        seed=0,
        **options,
    )


async def _crowd_behind(
    engine: TorchEngine, started: threading.Event, go: threading.Event, *, rows: int, crowd: int
) -> None:
    """One request of `rows` rows opens the loop; once the loop holds (`started`), `crowd`
    one-row requests queue behind it, then the loop goes on (`go`); returns once all are
    answered."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.generate, PROMPT, rows)
        while not started.is_set():
            await anyio.sleep(0.01)
        for _ in range(crowd):
            tg.start_soon(engine.generate, [5, 6, 7], 1)
        while len(engine._queue) < crowd:
            await anyio.sleep(0.01)
        go.set()


def _hold_draw(model: Decoder, number: int) -> tuple[threading.Event, threading.Event]:
    """Hold the compute thread at the model's ``number``-th draw (its lm_head call) until the
    second event is set; the first says it got there."""
    reached, go = threading.Event(), threading.Event()
    draws = 0

    def hold(*_: Any) -> None:  # on the compute thread, in the sampler's loop
        nonlocal draws
        draws += 1
        if draws == number:
            reached.set()
            go.wait(timeout=30)

    model.lm_head.register_forward_hook(hold)
    return reached, go


def _greedy(model: Decoder, prompt: list[int], n: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    ((out,),) = Sampler(model).generate(
        [(prompt, 1)], max_new_tokens=n, temperature=0.0, generator=torch.Generator().manual_seed(0)
    )
    return out.tokens, out.logprobs


async def test_a_request_frozen_at_a_stand_down_finishes_after_the_wake_with_its_tokens_and_versions() -> (
    None
):
    """The real engine and gate: a stand-down during a greedy request freezes it after its
    third token (the gate does not wait for it); the train step changes the weights; after
    the wake the request continues from its prompt and those three tokens under the new
    weights. The first three tokens and their logprobs are the old weights', the rest the new
    weights' continuation, and the stretches are tagged with the versions that made them."""
    model = _model()
    before = copy.deepcopy(model)
    engine = _engine(model, partial=True)
    gate = EngineGate(engine, DeadlineClock())
    at_third, go = _hold_draw(model, 3)
    result: dict[str, Any] = {}

    async def request() -> None:
        async with gate.serving():
            (result["completion"],) = await engine.generate(PROMPT, 1, greedy=True)

    async def train() -> None:
        assert not result, "the request finished before the step"
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate_up_proj.weight.mul_(-1)

    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(request)
                while not at_third.is_set():
                    await anyio.sleep(0.01)
                tg.start_soon(gate.step, train)
                while not engine._freeze.is_set():
                    await anyio.sleep(0.01)
                go.set()
    finally:
        engine.close()
    done = result["completion"]
    old_tokens, old_logprobs = _greedy(before, PROMPT, 3)
    new_tokens, new_logprobs = _greedy(model, PROMPT + list(old_tokens), 5)
    assert done.tokens == old_tokens + new_tokens
    assert done.logprobs == pytest.approx(old_logprobs + new_logprobs, abs=1e-5)
    assert done.finish_reason == "length"
    assert done.segments == ((0, 0), (3, 1))
    assert done.reprefilled_tokens == len(PROMPT) + 3
    assert [gate.version_after(wakes) for wakes in (0, 1)] == [0, 1]
    stats = engine.statistics()
    assert (stats.frozen_rows, stats.reprefilled_tokens, stats.frozen_now) == (1, 7, 0)


class _Scripted(LengthDraw):
    """Bench lengths given in order, one list per request."""

    def __init__(self, *limits: list[int]) -> None:
        super().__init__(BenchLengths(), max_new_tokens=8, seed=0)
        self.limits = list(limits)

    def draw(self, n: int) -> list[int]:
        got = self.limits.pop(0)
        assert len(got) == n
        return got


async def test_a_request_arriving_while_the_loop_runs_takes_a_freed_slot_and_finishes_first() -> None:
    """The real engine: a request of two rows (2 and 8 tokens) opens the loop; a second
    request queued while it runs is admitted into the first row's slot once that row ends,
    and is answered while the long row still decodes, in the same loop (the engine hands the
    sampler its queue as the source and answers requests from its sink). Greedy, every row
    equals its prompt alone; the slots count the loop's width at every step."""
    model = _model()
    other = [5, 6, 7]
    want = [_greedy(model, PROMPT, 2), _greedy(model, PROMPT, 8), _greedy(model, other, 3)]
    engine = _engine(model, lengths=_Scripted([2, 8], [3]))
    started, go = _hold_draw(model, 1)  # at the loop's first prefill
    answered: list[tuple[str, list[Any]]] = []
    finish, resolved = engine._finish, []

    def resolving(back: Any) -> None:  # the sink, on the compute thread
        finish(back)
        resolved.extend(admission.key[0].prompt for admission, _ in back if admission.key[0].done)

    engine._finish = resolving  # type: ignore[method-assign]

    async def ask(name: str, prompt: list[int], n: int) -> None:
        answered.append((name, await engine.generate(prompt, n, greedy=True)))

    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(ask, "first", PROMPT, 2)
                while not started.is_set():
                    await anyio.sleep(0.01)
                tg.start_soon(ask, "second", other, 1)
                while not engine._queue:
                    await anyio.sleep(0.01)
                go.set()
            await engine.compute.run(lambda: None)  # behind the loop: its sink calls are over
    finally:
        engine.close()
    assert resolved == [other, PROMPT]
    assert engine.calls == 1
    got = dict(answered)
    assert [(c.tokens, c.finish_reason) for c in got["first"] + got["second"]] == [
        (want[0][0], "stop"),
        (want[1][0], "length"),
        (want[2][0], "stop"),
    ]
    assert got["second"][0].logprobs == pytest.approx(want[2][1], abs=1e-5)
    stats = engine.statistics()
    assert (stats.slot_steps, stats.busy_slot_steps) == (2 * 8, 2 + 8 + 3)


async def test_an_answered_request_s_caller_goes_on_while_the_loop_still_decodes() -> None:
    """Two requests open one loop, one of 2 tokens and one of 8: the short one's caller is woken
    when its row is handed back (its own wake, not the loop's end), and returns while the loop
    is held at a later draw with the long row still decoding."""
    model = _model()
    engine = _engine(model, lengths=_Scripted([2], [8]))
    held, go = _hold_draw(model, 4)  # prefill, then decode steps: the short row ended at the 2nd
    short: list[Any] = []

    async def ask_short() -> None:
        short.append(await engine.generate(PROMPT, 1, greedy=True))

    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(ask_short)
                tg.start_soon(functools.partial(engine.generate, [5, 6, 7], 1, greedy=True))
                while not (held.is_set() and short):  # held, the loop waits (up to 30 s) for go
                    await anyio.sleep(0.01)
                assert engine._loop is not None  # answered while the loop was held, not at its end
                go.set()
    finally:
        go.set()
        engine.close()
    assert engine.calls == 1
    assert len(short[0][0].tokens) == 2


@pytest.mark.parametrize(("waiting", "loops", "slot_steps"), [(2, 1, 8 + 2 + 2), (3, 2, 8 + 3 * 2)])
async def test_a_narrow_loop_hands_a_crowd_of_waiting_requests_to_a_wider_one(
    waiting: int, loops: int, slot_steps: int
) -> None:
    """A loop opened by one row (one slot, 8 tokens) takes the requests queued while it runs
    (2 tokens each) through its slot while no more than twice its width waits; past that it
    admits nothing, ends with its row, and the next loop opens with a slot for each."""
    model = _model()
    engine = _engine(model, lengths=_Scripted([8], *[[2]] * waiting))
    started, go = _hold_draw(model, 1)
    try:
        with anyio.fail_after(60):
            await _crowd_behind(engine, started, go, rows=1, crowd=waiting)
    finally:
        engine.close()
    assert (engine.calls, engine.statistics().slot_steps) == (loops, slot_steps)


@pytest.mark.parametrize(("max_rows", "slot_steps"), [(0, 7 * 8), (2, 2 * 10)])
async def test_max_rows_caps_a_loop_and_the_rest_enter_as_its_rows_finish(
    max_rows: int, slot_steps: int
) -> None:
    """Seven one-row requests waiting together (2 tokens each, but the second's 8): without a
    cap the loop opens seven wide and runs to the long row (56 slot-steps for 20 tokens); at
    `max_rows` 2 it opens with the first two, and the other five follow through whichever slot
    frees, although more than twice the loop's width waits (a loop at its cap keeps admitting):
    both slots busy for all 10 steps."""
    model = _model()
    engine = _engine(model, lengths=_Scripted([2], [8], *[[2]] * 5), max_rows=max_rows)
    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for _ in range(7):
                    tg.start_soon(engine.generate, PROMPT, 1)
    finally:
        engine.close()
    stats = engine.statistics()
    assert (engine.calls, stats.slot_steps, stats.busy_slot_steps) == (1, slot_steps, 8 + 6 * 2)


async def test_at_max_rows_a_loop_opened_by_one_row_takes_a_crowd_at_once() -> None:
    """A loop opened by one long row (8 tokens: a row frozen at a stand-down, continuing after
    the wake) under `max_rows` 4 is four slots wide, so three requests queued while it runs
    (2 tokens each: the next batch) enter at its next check and are answered while the long
    row still decodes, in the same loop: the next batch never waits for the last one's tail.
    A loop as wide as its one row would admit none of them (more than twice its width waits)
    and end with its row first."""
    model = _model()
    engine = _engine(model, lengths=_Scripted([8], [2], [2], [2]), max_rows=4)
    started, go = _hold_draw(model, 1)
    finish, resolved = engine._finish, []

    def resolving(back: Any) -> None:  # the sink, on the compute thread
        finish(back)
        resolved.extend(admission.key[0].prompt for admission, _ in back if admission.key[0].done)

    engine._finish = resolving  # type: ignore[method-assign]
    try:
        with anyio.fail_after(60):
            await _crowd_behind(engine, started, go, rows=1, crowd=3)
            await engine.compute.run(lambda: None)  # behind the loop: its sink calls are over
    finally:
        engine.close()
    assert engine.calls == 1
    assert resolved == [[5, 6, 7]] * 3 + [PROMPT]
    stats = engine.statistics()
    assert (stats.slot_steps, stats.busy_slot_steps) == (4 * 8, 8 + 3 * 2)


async def test_at_max_rows_a_tail_decodes_narrow_and_the_next_batch_widens_it() -> None:
    """The real engine on a bucketed sampler (as on a GPU), `max_rows` 16: a request of two
    rows (1 and 8 tokens) opens the loop 16 wide; once the short row ends and nothing waits,
    the long row decodes 8 wide (a batch's tail). Ten one-row requests (2 tokens each: the
    next batch, admitted after a train step) queued while it runs enter at the next check,
    all of them: the loop widens back to 16 for them, and they are answered while the long
    row still decodes, in the same loop."""
    model = _model()
    engine = _engine(model, compiled=True, lengths=_Scripted([1, 8], *[[2]] * 10), max_rows=16)
    # Hold the loop at its second check (a hook on the model is not reliable under compile).
    started, go = threading.Event(), threading.Event()
    admit, checks = engine._admit, []

    def holding(greedy: bool, active: Any, rows: int | None, positions: int | None) -> Any:
        if rows is not None:
            checks.append(rows)
            if len(checks) == 2:
                started.set()
                go.wait(timeout=30)
        return admit(greedy, active, rows, positions)

    engine._admit = holding  # type: ignore[method-assign]
    try:
        with anyio.fail_after(120):
            await _crowd_behind(engine, started, go, rows=2, crowd=10)
    finally:
        go.set()
        engine.close()
    stats = engine.statistics()
    assert engine.calls == 1
    assert checks[:2] == [15, 15]  # its 16 slots less the long row's, offered even when 8 wide
    # 16 wide for one step, 8 for one, 16 for the ten's two steps, 8 for the long row's last four.
    assert (stats.slot_steps, stats.busy_slot_steps) == (16 + 8 + 16 * 2 + 8 * 4, 9 + 10 * 2)


def test_max_rows_below_a_group_is_refused() -> None:
    import pipeline

    with pytest.raises(pipeline.RecipeError) as error:
        pipeline.load_recipe("recipes/quickstart.yaml", ["rollout.max_rows=4"])
    assert str(error.value).endswith(
        "rollout.max_rows: 4 is below rollout.samples_per_prompt (8): a group's samples are "
        "generated together; set rollout.max_rows >= 8, or 0 for no cap"
    )


async def test_a_request_given_up_mid_loop_stops_taking_its_slots() -> None:
    """The real engine: two requests share a loop; the second's caller is cancelled while the
    loop runs. At the next check its row is dropped (no slot of it counted busy after that),
    and the first request is answered as if alone."""
    model = _model()
    want = _greedy(model, PROMPT, 8)
    engine = _engine(model)
    paused, go = _hold_draw(model, 2)
    answered: dict[str, Any] = {}
    left: set[str] = set()

    async def ask(name: str, prompt: list[int], scope: anyio.CancelScope) -> None:
        with scope:
            answered[name] = await engine.generate(prompt, 1, greedy=True)
        left.add(name)

    given_up = anyio.CancelScope()
    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(ask, "kept", PROMPT, anyio.CancelScope())
                tg.start_soon(ask, "given up", [5, 6, 7], given_up)
                while not paused.is_set():
                    await anyio.sleep(0.01)
                given_up.cancel()
                while "given up" not in left:  # its caller's cleanup marks the request cancelled
                    await anyio.sleep(0.01)
                go.set()
    finally:
        engine.close()
    assert list(answered) == ["kept"]
    assert answered["kept"][0].tokens == want[0]
    stats = engine.statistics()
    assert (stats.slot_steps, stats.busy_slot_steps) == (2 * 8, 8)


async def test_bench_lengths_end_each_sample_as_drawn_and_continue_across_a_resume() -> None:
    """`rollout.bench_lengths`: each sample ends at its drawn length ("stop"; a draw cut at
    max_new_tokens: "length"); the draw is the run seed's, and its state, saved with the
    engine's, continues the same sequence in a resumed engine."""
    lengths = BenchLengths(median_tokens=3, sigma=1.0)
    expected = LengthDraw(lengths, max_new_tokens=8, seed=5).draw(24)
    assert 8 in expected and min(expected) < 8  # both endings occur in these draws
    model = _model()
    engine = _engine(model, lengths=LengthDraw(lengths, max_new_tokens=8, seed=5))
    try:
        first = await engine.generate(PROMPT, 12)
        state = engine.state()
    finally:
        engine.close()
    resumed = _engine(model, lengths=LengthDraw(lengths, max_new_tokens=8, seed=5))
    try:
        resumed.load_state(state)
        second = await resumed.generate(PROMPT, 12)
    finally:
        resumed.close()
    got = [len(c.tokens) for c in first + second]
    assert got == expected
    assert [c.finish_reason for c in first + second] == ["stop" if n < 8 else "length" for n in expected]
    stats = resumed.statistics()
    assert stats.busy_slot_steps == sum(expected[12:])
    assert stats.slot_steps == 12 * max(expected[12:])


def test_the_lognormal_draw_has_the_stated_median_and_is_cut_at_max_new_tokens() -> None:
    draw = LengthDraw(BenchLengths(median_tokens=256, sigma=0.9), max_new_tokens=2048, seed=0).draw(20000)
    ordered = sorted(draw)
    assert 246 <= ordered[len(ordered) // 2] <= 266
    assert max(draw) == 2048 and min(draw) >= 1
    assert 0.005 < sum(n == 2048 for n in draw) / len(draw) < 0.02  # about 1% past p99
    other = LengthDraw(BenchLengths(median_tokens=256, sigma=0.9), max_new_tokens=2048, seed=1).draw(20)
    assert other != draw[:20]


def test_the_recipe_wires_bench_lengths_and_partial_rollouts_into_the_engine() -> None:
    """`rollout.bench_lengths`, `rollout.partial` and `rollout.max_rows` reach the engine the
    torch backend builds."""
    import pipeline
    from backends.torch.build import build_backend
    from pipeline.shell.backend_input import backend_input

    recipe = pipeline.load_recipe(
        "recipes/quickstart.yaml",
        ["rollout.partial=true", "rollout.bench_lengths={median_tokens: 2}", "rollout.max_rows=16"],
    )
    engine, trainer = build_backend(backend_input(recipe), vocab_size=16, stop_ids=())
    try:
        assert engine.partial_rollouts and engine.max_rows == 16
        assert engine.lengths is not None and set(engine.lengths.draw(50)) <= set(range(1, 6))
    finally:
        engine.close()
        trainer.close()
