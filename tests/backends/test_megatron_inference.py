"""The megatron inference adapter's stand-down/wake state machine, against a fake engine."""

from __future__ import annotations

import asyncio

import pytest

from backends.megatron.inference import MegatronInference, State
from pipeline.messages import Completion
from pipeline.testing import FakeDynamicEngine, InjectedFault


def _adapter(engine: FakeDynamicEngine) -> MegatronInference:
    return MegatronInference(engine, sampling=lambda greedy: {"greedy": greedy}, stop_token_ids=[9])


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
    assert engine.sampling == [{"greedy": False}, {"greedy": False}, {"greedy": True}]
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
    assert engine.events == ["add 0", "step", "suspend", "resume", "step", "step"]


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
    assert engine.events == ["suspend", "resume", "add 0", "step"]


async def test_an_engine_failure_fails_the_waiting_request_and_every_later_call() -> None:
    engine = FakeDynamicEngine(length=3, fail_at_step=2)
    adapter = _adapter(engine)
    with pytest.raises(InjectedFault, match="injected fault in engine step 2"):
        await adapter.generate([1], 2)
    with pytest.raises(InjectedFault):
        await adapter.stand_down()
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
