"""The `collective` transport's broadcast in a real gloo group of two processes: this test's
(an engine replica, rank 1) and a sender (the trainer's side, rank 0) started beside it.

A header that is not the announced version, or lacks a tensor, is refused before any payload
moves, and the group stays in step: the next, valid broadcast arrives whole.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from backends.ray import broadcast
from backends.ray.broadcast import Group, layout, receive
from backends.ray.weights import WeightsMismatch, header

SENDER = """
import sys, torch
from backends.ray.broadcast import Group, bucketed, send
group = Group()
print(*group.open(60.0), flush=True)
group.join(None, 0, 2, "gloo", 60.0)
weights = [("a.weight", torch.full((2, 3), 2.0)), ("b.weight", torch.arange(4.0).bfloat16())]
send(bucketed(3, weights))  # the replica waits for version 4
send(bucketed(4, weights[:1]))  # b.weight missing
send(bucketed(4, weights))
group.leave()
"""


def like() -> list[tuple[str, torch.Tensor]]:
    return [("a.weight", torch.zeros(2, 3)), ("b.weight", torch.zeros(4, dtype=torch.bfloat16))]


def test_a_refused_header_moves_no_payload_and_the_next_broadcast_arrives_whole() -> None:
    group = Group()
    with subprocess.Popen([sys.executable, "-c", SENDER], stdout=subprocess.PIPE, text=True) as sender:
        try:
            host, port = sender.stdout.readline().split()  # type: ignore[union-attr]
            group.join((host, int(port)), 1, 2, "gloo", 60.0)
            with pytest.raises(WeightsMismatch) as raised:
                receive(4, like())
            assert str(raised.value) == "weights of version 3 arrived for the refit to version 4"
            with pytest.raises(WeightsMismatch) as raised:
                receive(4, like())
            assert str(raised.value) == "weights of version 4: missing ['b.weight'], unexpected []"
            got = receive(4, like())
            assert torch.equal(got["a.weight"], torch.full((2, 3), 2.0))
            assert torch.equal(got["b.weight"], torch.arange(4.0).bfloat16())
        finally:
            group.leave()
            assert sender.wait(timeout=300) == 0


def test_buckets_hold_one_dtype_each_and_split_at_the_size_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(broadcast, "BUCKET_BYTES", 64)
    tensors = [
        ("a", torch.zeros(8)),  # 32 bytes
        ("b", torch.zeros(4, dtype=torch.bfloat16)),
        ("c", torch.zeros(8)),  # a + c: 64 bytes, one bucket
        ("d", torch.zeros(2)),  # over the cap: the next bucket
        ("e", torch.zeros(40)),  # larger than the cap: alone
    ]
    assert layout(header(0, tensors)) == [
        (torch.float32, [0, 2]),
        (torch.float32, [3]),
        (torch.float32, [4]),
        (torch.bfloat16, [1]),
    ]
