"""Channels: bounded (backpressure), closable (drain then end), inspectable."""

from __future__ import annotations

import anyio
import pytest

from pipeline.channel import Channel, ChannelStatistics


async def test_send_blocks_while_full_and_send_nowait_raises() -> None:
    channel: Channel[int] = Channel("c", 2)
    await channel.send(1)
    channel.send_nowait(2)
    with pytest.raises(anyio.WouldBlock):
        channel.send_nowait(3)
    sent = anyio.Event()

    async def producer() -> None:
        await channel.send(3)
        sent.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(producer)
        await anyio.wait_all_tasks_blocked()
        assert not sent.is_set()
        assert channel.statistics().waiting_senders == 1
        assert await channel.receive() == 1
        await sent.wait()
    assert channel.statistics().depth == 2
    assert [channel.receive_nowait(), channel.receive_nowait()] == [2, 3]


async def test_close_drains_buffered_items_then_ends_iteration() -> None:
    channel: Channel[int] = Channel("c", 3)
    for i in range(3):
        channel.send_nowait(i)
    channel.close()
    channel.close()  # idempotent
    assert [item async for item in channel] == [0, 1, 2]
    with pytest.raises(anyio.EndOfStream):
        await channel.receive()
    with pytest.raises(anyio.ClosedResourceError):
        await channel.send(9)


async def test_close_wakes_a_waiting_receiver() -> None:
    channel: Channel[int] = Channel("c", 1)
    received: list[int] = []

    async def consumer() -> None:
        async for item in channel:
            received.append(item)

    async with anyio.create_task_group() as tg:
        tg.start_soon(consumer)
        await anyio.wait_all_tasks_blocked()
        assert channel.statistics().waiting_receivers == 1
        await channel.send(7)
        channel.close()
    assert received == [7]


async def test_statistics_depth_peak_and_waiters() -> None:
    channel: Channel[str] = Channel("scored", 3)
    assert channel.statistics() == ChannelStatistics(
        name="scored",
        capacity=3,
        depth=0,
        peak_depth=0,
        waiting_senders=0,
        waiting_receivers=0,
        sent=0,
        closed=False,
    )
    for item in "abc":
        await channel.send(item)
    channel.receive_nowait()
    channel.receive_nowait()
    assert channel.statistics() == ChannelStatistics(
        name="scored",
        capacity=3,
        depth=1,
        peak_depth=3,
        waiting_senders=0,
        waiting_receivers=0,
        sent=3,
        closed=False,
    )
    assert channel.receive_nowait() == "c"
    channel.close()
    stats = channel.statistics()
    assert (stats.depth, stats.peak_depth, stats.closed) == (0, 3, True)


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="channel 'x' needs a capacity >= 1, got 0"):
        Channel("x", 0)
