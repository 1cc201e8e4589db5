"""The prompt stage: admits one batch of prompts per admission ticket, while more are needed."""

from __future__ import annotations

from collections.abc import Iterator

from pipeline.channel import Channel
from pipeline.contracts.messages import Batch, Prompt
from pipeline.tickets import TicketBox
from stages.context import RunContext
from stages.progress import Progress


class PromptStage:
    """Admits one batch of `prompts_per_step` prompts per ticket until the run has enough."""

    name = "prompts"

    def __init__(
        self,
        prompts: Iterator[Prompt],
        *,
        prompts_per_step: int,
        tickets: TicketBox,
        out: Channel[Batch],
        progress: Progress,
        context: RunContext,
    ) -> None:
        self.prompts = prompts
        self.prompts_per_step = prompts_per_step
        self.tickets = tickets
        self.out = out
        self.progress = progress
        self.watchdog = context.watchdog
        self.trace = context.trace
        self.timings = context.timings

    async def run(self) -> None:
        try:
            while True:
                with self.watchdog.waiting(self.name, "more batches to be needed"):
                    if not await self.progress.wait_batch_needed():
                        return
                waited = self.trace.now()
                with self.watchdog.waiting(self.name, "an admission ticket"):
                    ticket = await self.tickets.take()
                if ticket is None:
                    return
                start = self.trace.now()
                batch = Batch(
                    batch=ticket.batch,
                    prompts=tuple(next(self.prompts) for _ in range(self.prompts_per_step)),
                )
                end = self.trace.now()
                self.trace.span("ticket wait", waited, start, track="prompts")
                self.trace.span(f"load batch {batch.batch}", start, end, track="prompts")
                self.timings.add(batch.batch, "prompts", end - start)
                self.progress.batch_admitted()
                with self.watchdog.waiting(self.name, "room in the rollout channel"):
                    await self.out.send(batch)
        finally:
            self.out.close()
            self.watchdog.done(self.name)
