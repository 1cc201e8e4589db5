"""Bounded, closable channels between stages.

A `Channel` is one anyio memory object stream pair with a fixed capacity, owned by the pipeline.
The producing stage `send`s (blocking while the channel is full: that is the backpressure) and
calls `close()` when it has nothing more; the consuming stage iterates with `async for`, which
ends once the channel is closed and drained. `statistics()` reports current and peak depth and
how many tasks wait on either side.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Generic, TypeVar

import anyio
import msgspec

T = TypeVar("T")


class ChannelStatistics(msgspec.Struct, frozen=True):
    name: str
    capacity: int
    depth: int
    peak_depth: int
    waiting_senders: int
    waiting_receivers: int
    sent: int
    closed: bool


class Channel(Generic[T]):
    def __init__(self, name: str, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"channel {name!r} needs a capacity >= 1, got {capacity}")
        self.name = name
        self.capacity = capacity
        self._send, self._receive = anyio.create_memory_object_stream[T](capacity)
        self._peak = 0
        self._sent = 0
        self._closed = False

    async def send(self, item: T) -> None:
        """Send, waiting while the channel is full."""
        await self._send.send(item)
        self._after_send()

    def send_nowait(self, item: T) -> None:
        """Send or raise `anyio.WouldBlock` if the channel is full."""
        self._send.send_nowait(item)
        self._after_send()

    def _after_send(self) -> None:
        self._sent += 1
        self._peak = max(self._peak, self._send.statistics().current_buffer_used)

    async def receive(self) -> T:
        """Receive the next item; raises `anyio.EndOfStream` once closed and drained."""
        try:
            return await self._receive.receive()
        except anyio.EndOfStream:
            self._receive.close()  # drained: release the receiving end (anyio warns otherwise)
            raise
        except anyio.ClosedResourceError:
            raise anyio.EndOfStream from None

    def receive_nowait(self) -> T:
        try:
            return self._receive.receive_nowait()
        except anyio.EndOfStream:
            self._receive.close()
            raise
        except anyio.ClosedResourceError:
            raise anyio.EndOfStream from None

    def close(self) -> None:
        """No more items will be sent; receivers drain what is buffered, then stop."""
        if not self._closed:
            self._closed = True
            self._send.close()

    async def __aiter__(self) -> AsyncIterator[T]:
        while True:
            try:
                yield await self.receive()
            except anyio.EndOfStream:
                return

    def __del__(self) -> None:
        # The channel owns both ends. Once it is unreachable nobody can use them; closing them
        # here keeps a pipeline that was cancelled or failed mid-run (its channels never drained)
        # from tripping anyio's "unclosed stream" ResourceWarning at garbage collection.
        if hasattr(self, "_receive"):
            self._send.close()
            self._receive.close()

    def statistics(self) -> ChannelStatistics:
        stats = self._send.statistics()
        return ChannelStatistics(
            name=self.name,
            capacity=self.capacity,
            depth=stats.current_buffer_used,
            peak_depth=self._peak,
            waiting_senders=stats.tasks_waiting_send,
            waiting_receivers=stats.tasks_waiting_receive,
            sent=self._sent,
            closed=self._closed,
        )
