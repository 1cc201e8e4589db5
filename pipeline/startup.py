"""Start-up without long pauses of the event loop: `with start_up(): ...` around the work that
builds a run (importing torch, building the model), which runs on worker threads.

That work allocates hundreds of thousands of objects that live as long as the process, and
the garbage collector's full passes over them hold the GIL, so the loop, for 100-300 ms each
(five of them in a quickstart's first five seconds on a 2-core machine), from whichever thread
triggers them. Inside `start_up` the collector is paused; at its end what exists is frozen
(`gc.freeze`: later passes skip it) and collection resumes. `thaws_after` (on the run) hands
what was frozen back to the collector, so a host that runs pipelines one after another gets
each run's backend (its model, optimizer and caches, held in reference cycles) reclaimed.

What start-up is doing (loading torch, building the model, starting Ray, the first evaluation:
seconds each on a small machine) is said at info on the logger named `NARRATION`. Backends log
to it by that name (they import nothing of the pipeline's); the command line shows its lines
on the console, with the run's other lines, and keeps them off stderr (`validate` and a failed
start print one error line there, nothing else); an embedding application sees them in its
own logging.
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

NARRATION = "pipeline.startup"

P = ParamSpec("P")
T = TypeVar("T")


@contextmanager
def start_up() -> Iterator[None]:
    enabled = gc.isenabled()  # False inside another `start_up`: the outer one re-enables
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def thaws_after(run: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    """``run``, after which (however it ends) what `start_up` froze can be collected again."""

    @functools.wraps(run)
    async def thawing(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await run(*args, **kwargs)
        finally:
            gc.unfreeze()

    return thawing


def say(message: str, *args: object) -> None:
    """One line of what start-up is doing now (see the module's docstring)."""
    logging.getLogger(NARRATION).info(message, *args)
