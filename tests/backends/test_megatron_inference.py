"""The megatron inference adapter's stand-down/wake state machine, against a fake engine."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from backends.bench_lengths import LengthDraw
from backends.megatron.inference import MegatronInference, State
from pipeline.contracts.errors import RequestRejected
from pipeline.contracts.messages import Completion
from pipeline.contracts.sections import BenchLengths
from pipeline.testing import FakeDynamicEngine, InjectedFault


def _sampling(greedy: bool, limit: int) -> SimpleNamespace:
    return SimpleNamespace(greedy=greedy, num_tokens_to_generate=limit)


def _adapter(engine: FakeDynamicEngine, **options) -> MegatronInference:
    options.setdefault("max_new_tokens", 3)
    return MegatronInference(lambda: engine, sampling=_sampling, stop_token_ids=[9], **options)


async def test_generate_returns_each_requests_tokens_and_logprobs() -> None:
    engine = FakeDynamicEngine(length=3, stop_at=[9])
    adapter = _adapter(engine)
    try:
        first, second = await asyncio.gather(
            adapter.generate([1, 2], 2), adapter.generate([6], 1, greedy=True)
        )
    finally:
        adapter.close()
    length = Completion(tokens=(3, 4, 5), logprobs=(-0.5, -0.5, -0.5), finish_reason="length")
    assert first == [length, length]
    assert second == [Completion(tokens=(7, 8, 9), logprobs=(-0.5,) * 3, finish_reason="stop")]
    assert engine.sampling == [_sampling(False, 3), _sampling(False, 3), _sampling(True, 3)]
    assert adapter.blocks_training and adapter.wake_carries_weights


async def test_requests_in_flight_freeze_while_down_and_finish_after_the_wake() -> None:
    engine = FakeDynamicEngine(length=3, hold_after_steps=1)
    adapter = _adapter(engine)
    try:
        request = asyncio.ensure_future(adapter.generate([1], 1))
        await asyncio.to_thread(engine.wait_steps, 1)
        await adapter.stand_down()
        assert adapter.state is State.DOWN
        engine.release()
        assert not request.done()
        await adapter.wake()
        assert adapter.state is State.SERVING
        (completion,) = await request
    finally:
        adapter.close()
    assert completion.tokens == (2, 3, 4)
    # The last suspend is the close's: a serving engine lets go of its cache and megatron's
    # process-wide inference flag before its thread ends.
    assert engine.events == ["add 0", "step", "suspend", "resume", "step", "step", "suspend"]


async def test_the_model_is_made_ready_to_serve_once_built_and_at_every_wake() -> None:
    """`serving` (the builder's `model.eval`: megatron's inference attention asserts eval mode,
    and the trainer's step leaves train mode on) runs on the engine's thread after the build and
    after each resume, before anything is stepped."""
    engine = FakeDynamicEngine(length=1)
    adapter = _adapter(engine, serving=lambda: engine.events.append("serving"))
    try:
        await adapter.generate([1], 1)
        for _ in range(2):
            await adapter.stand_down()
            await adapter.wake()
        await adapter.generate([1], 1)
    finally:
        adapter.close()
    assert engine.events == [
        "serving", "add 0", "step", "suspend", "resume", "serving", "suspend", "resume", "serving",
        "add 1", "step", "suspend",
    ]  # fmt: skip


class _RecordingHandoff:
    """A graphed engine's cache handoff that writes what it is asked into the engine's events."""

    def release(self, engine: FakeDynamicEngine) -> None:
        engine.events.append("release")

    def restore(self, engine: FakeDynamicEngine) -> None:
        engine.events.append("restore")

    def close(self, engine: FakeDynamicEngine) -> None:
        engine.events.append("close")


async def test_a_graphed_engines_cache_goes_after_each_suspend_and_returns_before_each_resume() -> None:
    """The cache's memory is let go once megatron's suspend is done with it, mapped again before
    its resume re-adds requests into it, and freed for good after the close's suspend."""
    engine = FakeDynamicEngine(length=1)
    adapter = _adapter(engine, handoff=_RecordingHandoff())
    try:
        await adapter.generate([1], 1)
        await adapter.stand_down()
        await adapter.wake()
        await adapter.generate([1], 1)
    finally:
        adapter.close()
    assert engine.events == [
        "add 0", "step", "suspend", "release", "restore", "resume", "add 1", "step", "suspend", "close",
    ]  # fmt: skip


async def test_a_request_made_while_down_enters_the_engine_at_the_wake() -> None:
    engine = FakeDynamicEngine(length=1)
    adapter = _adapter(engine)
    try:
        await adapter.stand_down()
        await adapter.stand_down()  # twice: still one suspend
        request = asyncio.ensure_future(adapter.generate([1], 1))
        await asyncio.sleep(0)
        await adapter.wake()
        await adapter.wake()
        await request
    finally:
        adapter.close()
    assert engine.events == ["suspend", "resume", "add 0", "step", "suspend"]


async def test_an_engine_failure_fails_the_waiting_request_and_every_later_call() -> None:
    engine = FakeDynamicEngine(length=3, fail_at_step=2)
    adapter = _adapter(engine)
    with pytest.raises(InjectedFault, match="injected fault in engine step 2"):
        await adapter.generate([1], 2)
    with pytest.raises(InjectedFault):
        await adapter.stand_down()
    adapter.close()
    assert adapter.state is State.CLOSED


class _LosingLogprobs(FakeDynamicEngine):
    """Reports its finished requests with one logprob fewer than tokens (a bug's record)."""

    def step_modern(self) -> dict:
        result = super().step_modern()
        for request in result["finished_request_records"]:
            request.generated_log_probs.pop()
        return result


async def test_a_finished_request_the_adapter_cannot_read_fails_its_own_caller() -> None:
    """The failure is the engine thread's (a bug): the request it was reading gets it too,
    rather than waiting forever."""
    adapter = _adapter(_LosingLogprobs(length=2))
    try:
        with pytest.raises(AssertionError):
            await asyncio.wait_for(adapter.generate([1], 1), 30)
    finally:
        adapter.close()
    assert adapter.state is State.CLOSED


async def test_close_fails_what_is_still_pending() -> None:
    engine = FakeDynamicEngine(length=3, hold_after_steps=0)
    adapter = _adapter(engine)
    request = asyncio.ensure_future(adapter.generate([1], 1))
    await asyncio.sleep(0)
    await adapter.stand_down()  # the add has been handled: it precedes the suspend
    adapter.close()
    with pytest.raises(RuntimeError, match="the megatron inference engine closed"):
        await request
    with pytest.raises(RuntimeError, match="the megatron inference engine is closed"):
        await adapter.generate([1], 1)


async def test_bench_lengths_end_requests_early_as_a_stop_and_their_draw_is_saved(tmp_path: Path) -> None:
    """Each request's drawn length reaches the engine as its own limit; one cut short of
    max_new_tokens reads as a stop, as in the torch engine; a resume continues the draw."""
    lengths = BenchLengths(median_tokens=2, sigma=1.0)
    adapter = _adapter(
        FakeDynamicEngine(length=8),
        max_new_tokens=8,
        lengths=LengthDraw(lengths, max_new_tokens=8, seed=0),
    )
    expected = LengthDraw(lengths, max_new_tokens=8, seed=0).draw(12)
    try:
        completions = await adapter.generate([10], 6)  # tokens 11, 12, ...: no stop token
        adapter.save(tmp_path)
        later = await adapter.generate([10], 6)
    finally:
        adapter.close()
    assert [len(c.tokens) for c in completions + later] == expected
    assert [c.finish_reason for c in completions] == ["stop" if n < 8 else "length" for n in expected[:6]]
    resumed = _adapter(
        FakeDynamicEngine(length=8), max_new_tokens=8, lengths=LengthDraw(lengths, max_new_tokens=8, seed=5)
    )
    try:
        resumed.load(tmp_path)
        again = await resumed.generate([10], 6)
    finally:
        resumed.close()
    assert [len(c.tokens) for c in again] == expected[6:]


async def test_a_prompt_too_long_for_the_engine_is_rejected_before_it_enters() -> None:
    engine = FakeDynamicEngine(length=3)
    adapter = _adapter(engine, max_sequence_length=6)
    try:
        with pytest.raises(RequestRejected) as raised:
            await adapter.generate([1, 2, 3, 4], 2)
        assert len(await adapter.generate([1, 2, 3], 1)) == 1  # 3 + 3 fits
    finally:
        adapter.close()
    assert str(raised.value) == (
        "a prompt of 4 tokens + 3 new tokens exceeds the megatron engine's max sequence length 6"
    )
    assert engine.events == ["add 0", "step", "step", "step", "suspend"]


def test_a_failed_build_is_raised_by_the_constructor() -> None:
    def build() -> FakeDynamicEngine:
        raise InjectedFault("no GPU")

    with pytest.raises(InjectedFault, match="no GPU"):
        MegatronInference(build, sampling=_sampling, stop_token_ids=[9], max_new_tokens=3)


async def test_the_engine_is_built_and_stepped_on_its_own_thread_away_from_the_event_loop() -> None:
    """megatron's engine adopts the event loop running where it is built, for its own
    run_until_complete in every step: built here (a loop runs) it could never step."""
    seen = []

    def build() -> FakeDynamicEngine:
        try:
            asyncio.get_running_loop()
            seen.append("a loop runs")
        except RuntimeError:
            seen.append("no loop")
        return FakeDynamicEngine(length=1)

    adapter = MegatronInference(build, sampling=_sampling, stop_token_ids=[9], max_new_tokens=1)
    adapter.close()
    assert seen == ["no loop"]


async def test_partial_rollouts_continue_frozen_requests_on_the_new_weights() -> None:
    """A stand-down freezes the requests in flight (megatron's recompute suspend, after the
    adapter's `freeze`); after the wake they continue where they were, under the new weights
    (the fake's logprob -1.5 from there), each stretch tagged with the wakes served when it
    was generated and the tokens prefilled again counted (prompt + tokens so far). A request
    made while down starts after the wake, in one stretch."""
    engine = FakeDynamicEngine(length=4, hold_after_steps=2, recompute=True)
    adapter = _adapter(
        engine, max_new_tokens=4, partial=True, freeze=lambda engine: engine.events.append("freeze")
    )
    try:
        request = asyncio.ensure_future(adapter.generate([1, 2], 2))
        await asyncio.to_thread(engine.wait_steps, 2)
        await adapter.stand_down()
        engine.weights = 1  # the train step
        engine.release()
        late = asyncio.ensure_future(adapter.generate([5], 1))
        await asyncio.sleep(0)  # its add reaches the engine thread before the wake
        await adapter.wake()
        continued = await request
        (fresh,) = await late
    finally:
        adapter.close()
    assert adapter.partial_rollouts and adapter.wakes == 1
    assert (
        continued
        == [
            Completion(
                tokens=(3, 4, 5, 6),
                logprobs=(-0.5, -0.5, -1.5, -1.5),
                finish_reason="length",
                segments=((0, 0), (2, 1)),
                reprefilled_tokens=2 + 2,
            )
        ]
        * 2
    )
    assert fresh == Completion(
        tokens=(6, 7, 8, 9), logprobs=(-1.5,) * 4, finish_reason="stop", segments=((0, 1),)
    )
    assert engine.events[:9] == [
        "add 0", "add 1", "step", "step", "freeze", "suspend", "resume", "recompute 0", "recompute 1",
    ]  # fmt: skip


async def test_a_request_frozen_before_its_first_token_has_its_one_stretch_retagged() -> None:
    """Nothing generated before the stand-down: all its tokens are the new weights', in one
    stretch tagged with the wake, and nothing counts as prefilled again."""
    engine = FakeDynamicEngine(length=2, hold_after_steps=0, recompute=True)
    adapter = _adapter(engine, max_new_tokens=2, partial=True)
    try:
        request = asyncio.ensure_future(adapter.generate([1], 1))
        await asyncio.sleep(0)
        await adapter.stand_down()
        engine.release()
        await adapter.wake()
        (completion,) = await request
    finally:
        adapter.close()
    assert (completion.segments, completion.reprefilled_tokens) == (((0, 1),), 0)


async def test_without_partial_rollouts_a_completion_carries_no_stretches() -> None:
    """(The gate drains such an engine before each stand-down: nothing is frozen then.)"""
    engine = FakeDynamicEngine(length=3, hold_after_steps=1, recompute=True)
    adapter = _adapter(engine)
    try:
        request = asyncio.ensure_future(adapter.generate([1], 1))
        await asyncio.to_thread(engine.wait_steps, 1)
        await adapter.stand_down()
        engine.release()
        await adapter.wake()
        (completion,) = await request
    finally:
        adapter.close()
    assert not adapter.partial_rollouts and completion.segments == ()


class _Paced(FakeDynamicEngine):
    """Steps only as the test lets it (`go.release(n)`: n more steps)."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.go = threading.Semaphore(0)

    def step_modern(self):
        self.go.acquire()
        return super().step_modern()


async def test_apart_a_refit_refreshes_the_model_once_the_requests_in_flight_have_finished(
    tmp_path: Path,
) -> None:
    """An engine with a model of its own (`refresh_weights`) never stands down; its refit lets
    the request in flight finish under the weights it started with, then refreshes the model
    and takes its fingerprint; a request made meanwhile enters after it, under the new
    weights. A resume's `load` refreshes too (from a worker thread)."""
    engine = _Paced(length=3)

    def refresh() -> None:
        engine.events.append("refresh")
        engine.weights += 1

    adapter = _adapter(engine, refresh_weights=refresh, fingerprint=lambda: {"weights": engine.weights})
    assert not adapter.blocks_training and not adapter.wake_carries_weights
    try:
        first = asyncio.ensure_future(adapter.generate([1], 1))
        await asyncio.sleep(0)
        refit = asyncio.ensure_future(adapter.refit())
        later = asyncio.ensure_future(adapter.generate([5], 1))
        await asyncio.sleep(0)  # both queued behind the first request's add
        assert adapter.fingerprint() is None  # no refresh yet
        engine.go.release(6)
        await refit
        (old,) = await first
        (new,) = await later
        assert adapter.fingerprint() == {"weights": 1}
        adapter.save(tmp_path)
        await asyncio.to_thread(adapter.load, tmp_path)
        assert adapter.fingerprint() == {"weights": 2}
    finally:
        adapter.close()
    assert (old.logprobs, new.logprobs) == ((-0.5,) * 3, (-1.5,) * 3)
    assert engine.events == [
        "add 0", "step", "step", "step", "refresh", "add 1", "step", "step", "step", "refresh", "suspend",
    ]  # fmt: skip
