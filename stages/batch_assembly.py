"""The batch assembler: gathers each batch's scored groups and drops, hands out whole batches.

Groups arrive in any order and from batches generated ahead (up to L of them); a batch is whole
once each of its `prompts_per_step` prompts has arrived as a group or a drop. Batches come out
in batch order, each in prompt order, not arrival order (rewards are scored concurrently): a
step's figures then do not depend on thread timing, and a resumed run repeats them exactly.
"""

from __future__ import annotations

from collections import defaultdict

import anyio

from pipeline.channel import Channel
from pipeline.contracts.messages import Dropped, Group


class BatchAssembler:
    def __init__(self, inp: Channel[Group | Dropped], *, prompts_per_step: int, first_batch: int) -> None:
        self.inp = inp
        self.prompts_per_step = prompts_per_step
        self.next_batch = first_batch  # the batch `next` returns; earlier ones are done
        self._pending: defaultdict[int, list[Group | Dropped]] = defaultdict(list)

    async def next(self) -> list[Group | Dropped] | None:
        """Batch `next_batch`'s groups and drops once all have arrived; None once the channel has
        closed first. Call `done` when it has been trained (or given up)."""
        while len(self._pending[self.next_batch]) < self.prompts_per_step:
            try:
                item = await self.inp.receive()
            except anyio.EndOfStream:
                return None
            self._pending[item.target_step].append(item)
        return sorted(self._pending.pop(self.next_batch), key=lambda item: _natural(item.group_id))

    def done(self) -> None:
        self.next_batch += 1


def _natural(group_id: str) -> tuple[int | str, ...]:
    """ "12-3" -> (12, 3): group ids in numeric order."""
    return tuple(int(part) if part.isdigit() else part for part in group_id.split("-"))
