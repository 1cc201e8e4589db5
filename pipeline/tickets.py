"""Admission tickets: how far generation may run ahead of training.

`L = max_lookahead_versions`. `L + 1` tickets circulate. The prompt stage takes a ticket before
it admits the batch for a step; the train stage gives it back only after the step that consumed
that batch has published its new weights to the engine. Hence at most L + 1 batches are admitted
and not yet consumed, and every sample trained at step k was generated from weights of version
>= k - L. A batch that ends empty (every group dropped) gives its ticket back all the same.

Tickets are numbered: the n-th ticket taken admits batch n, so `Ticket.batch` is the batch's
position in the run (continuing from a checkpoint's value).
"""

from __future__ import annotations

import anyio
import msgspec


class Ticket(msgspec.Struct, frozen=True):
    batch: int


class TicketStatistics(msgspec.Struct, frozen=True):
    capacity: int
    available: int
    outstanding: int
    waiters: int
    issued: int
    closed: bool


class TicketBox:
    """L + 1 tickets; `take` waits for one, `give_back` returns it, `close` ends admission."""

    def __init__(self, max_lookahead_versions: int, first_batch: int = 0) -> None:
        if max_lookahead_versions < 0:
            raise ValueError("max_lookahead_versions must be >= 0")
        self.capacity = max_lookahead_versions + 1
        self._available = self.capacity
        self._next_batch = first_batch
        self._outstanding: set[int] = set()
        self._changed = anyio.Event()
        self._waiters = 0
        self._closed = False

    async def take(self) -> Ticket | None:
        """Wait for a free ticket; None once the box is closed."""
        self._waiters += 1
        try:
            while not self._closed and self._available == 0:
                await self._wait_changed()
        finally:
            self._waiters -= 1
        if self._closed:
            return None
        self._available -= 1
        ticket = Ticket(batch=self._next_batch)
        self._next_batch += 1
        self._outstanding.add(ticket.batch)
        return ticket

    def give_back(self, ticket: Ticket) -> None:
        if ticket.batch not in self._outstanding:
            raise RuntimeError(f"ticket for batch {ticket.batch} was not outstanding")
        self._outstanding.remove(ticket.batch)
        self._available += 1
        self._notify()

    def close(self) -> None:
        self._closed = True
        self._notify()

    async def _wait_changed(self) -> None:
        await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def statistics(self) -> TicketStatistics:
        return TicketStatistics(
            capacity=self.capacity,
            available=self._available,
            outstanding=len(self._outstanding),
            waiters=self._waiters,
            issued=self._next_batch,
            closed=self._closed,
        )
