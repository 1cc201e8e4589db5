"""A step's completions and train groups cross the actor boundary as msgpack, bit for bit; an
engine actor's answer gives each request its own completions or its own error."""

from __future__ import annotations

import math
import struct
from collections import Counter
from typing import Any

import anyio

from backends.ray.actors import BackendPart
from backends.ray.engines import RayEngine, Replica
from backends.ray.wire import decode_completions, decode_groups, encode_completions, encode_groups
from pipeline.contracts.errors import RequestRejected
from pipeline.contracts.messages import Completion, TrainGroup, TrainSample
from pipeline.testing import FakeEngine

# Values a float32 or a decimal text would change; NaN and infinities from a poisoned sample.
FLOATS = (0.1 + 0.2, -1e-300, 2.0**-1074, -math.inf, math.nan, -0.0)


def bits(values: tuple[float, ...]) -> list[bytes]:
    return [struct.pack("<d", value) for value in values]


def test_completions_and_train_groups_come_back_bit_for_bit() -> None:
    completion = Completion(
        tokens=(3, 1, 4),
        logprobs=FLOATS,
        finish_reason="stop",
        segments=((0, 1), (2, 2)),
        reprefilled_tokens=7,
    )
    [[back], failed] = decode_completions(encode_completions([[completion], None]))
    assert failed is None
    assert (back.tokens, back.finish_reason, back.segments, back.reprefilled_tokens) == (
        (3, 1, 4),
        "stop",
        ((0, 1), (2, 2)),
        7,
    )
    assert bits(back.logprobs) == bits(FLOATS)
    sample = TrainSample(tokens=(5, 9), logprobs=FLOATS, reward=1 / 3, advantage=-(2**0.5))
    group = TrainGroup(group_id="g-7", prompt_tokens=(1, 2), samples=(sample, sample))
    [got] = decode_groups(encode_groups([group]))
    assert (got.group_id, got.prompt_tokens, len(got.samples)) == ("g-7", (1, 2), 2)
    for copy in got.samples:
        assert (copy.tokens, copy.reward, copy.advantage) == ((5, 9), 1 / 3, -(2**0.5))
        assert bits(copy.logprobs) == bits(FLOATS)


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)  # a coroutine: awaited as Ray's reference would be


class _Actor:
    """A `BackendPart` behind `.method.remote(...)`, in this process: the proxy and the actor's
    own code, without Ray between them."""

    def __init__(self, part: BackendPart) -> None:
        self.generate = _Method(part.generate)


async def test_an_engine_actors_answer_gives_each_request_its_completions_or_its_own_error() -> None:
    part = BackendPart.__new__(BackendPart)  # the actor's state without building a torch backend
    part.version, part.served = 0, set()
    part.engine = engine = FakeEngine(errors={1: RequestRejected("fake engine rejected call 1")})
    proxy = RayEngine(
        [Replica(0, _Actor(part), {})],
        spawn=None,
        publish=None,
        colocated=True,
        max_restarts=0,
        counts=Counter(),
    )
    answers: dict[int, Any] = {}

    async def one(first_token: int) -> None:
        try:
            answers[first_token] = await proxy.generate([first_token, 0], 2)
        except RequestRejected as error:
            answers[first_token] = str(error)

    async with anyio.create_task_group() as group:
        for first_token in (10, 20, 30):  # calls 0, 1, 2 of the engine, in this order
            group.start_soon(one, first_token)
    assert proxy.replicas[0].calls == 1  # the three travelled in one call
    assert answers[20] == "fake engine rejected call 1"
    for first_token in (10, 30):
        assert [c.tokens for c in answers[first_token]] == [(first_token,) * 4, (first_token + 1,) * 4]
        assert all(c.logprobs == (-1.0,) * 4 for c in answers[first_token])
    assert engine.calls == 3
