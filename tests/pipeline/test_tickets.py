"""Admission tickets: L + 1 of them, numbered, given back once, closed with None."""

from __future__ import annotations

import anyio
import pytest

from pipeline.tickets import Ticket, TicketBox, TicketStatistics


@pytest.mark.parametrize("lookahead", [0, 1, 3])
async def test_l_plus_one_tickets_then_take_waits(lookahead: int) -> None:
    box = TicketBox(lookahead)
    tickets = [await box.take() for _ in range(lookahead + 1)]
    assert tickets == [Ticket(batch=i) for i in range(lookahead + 1)]
    taken: list[Ticket | None] = []

    async def taker() -> None:
        taken.append(await box.take())

    async with anyio.create_task_group() as tg:
        tg.start_soon(taker)
        await anyio.wait_all_tasks_blocked()
        assert taken == []
        assert box.statistics().waiters == 1
        box.give_back(tickets[0])
    assert taken == [Ticket(batch=lookahead + 1)]


async def test_numbering_continues_from_first_batch() -> None:
    box = TicketBox(1, first_batch=7)
    first = await box.take()
    second = await box.take()
    assert (first, second) == (Ticket(batch=7), Ticket(batch=8))
    box.give_back(second)
    assert await box.take() == Ticket(batch=9)
    assert box.statistics() == TicketStatistics(
        capacity=2, available=0, outstanding=2, waiters=0, issued=10, closed=False
    )


async def test_give_back_of_a_ticket_not_outstanding_raises() -> None:
    box = TicketBox(1)
    ticket = await box.take()
    assert ticket is not None
    box.give_back(ticket)
    with pytest.raises(RuntimeError, match="ticket for batch 0 was not outstanding"):
        box.give_back(ticket)
    with pytest.raises(RuntimeError, match="ticket for batch 5 was not outstanding"):
        box.give_back(Ticket(batch=5))
    assert box.statistics().available == 2


async def test_close_wakes_waiters_with_none() -> None:
    box = TicketBox(0)
    await box.take()
    results: list[Ticket | None] = []

    async def taker() -> None:
        results.append(await box.take())

    async with anyio.create_task_group() as tg:
        for _ in range(2):
            tg.start_soon(taker)
        await anyio.wait_all_tasks_blocked()
        assert box.statistics().waiters == 2
        box.close()
    assert results == [None, None]
    assert await box.take() is None
    assert box.statistics().closed


def test_negative_lookahead_is_refused() -> None:
    with pytest.raises(ValueError, match="max_lookahead_versions must be >= 0"):
        TicketBox(-1)
