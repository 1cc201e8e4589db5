"""Start-up without long pauses of the event loop: `with start_up(): ...` around the work that
builds a run (importing torch, building the model), which runs on worker threads.

That work allocates hundreds of thousands of objects that live as long as the process, and
the garbage collector's full passes over them hold the GIL, so the loop, for 100-300 ms each
(five of them in a quickstart's first five seconds on a 2-core machine), from whichever thread
triggers them. Inside `start_up` the collector is paused; at its end what exists is frozen
(`gc.freeze`: later passes skip it) and collection resumes. `thaws_after` (on the run) hands
what was frozen back to the collector, so a host that runs pipelines one after another gets
each run's backend (its model, optimizer and caches, held in reference cycles) reclaimed.

A module without a fresh bytecode cache is compiled as it is imported, in one call that holds
the GIL for the whole module (tens of milliseconds for the larger ones here on a small
machine): on a worker thread, that call pauses the loop as long. A fresh clone's first run, or
the first after an edit, imports dozens such. `cache_bytecode` (before the stages are
imported) has a child process compile the packages' stale modules and write the caches the
imports would have written, so this process only reads them. With bytecode writing off
(`PYTHONDONTWRITEBYTECODE`, `-B`), with no interpreter to start (an embedding host's empty
`sys.executable`, a frozen app's), and for caches it cannot write (a read-only checkout) it
starts no child, and the imports compile as before.

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
import importlib.util
import logging
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
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


def cache_bytecode(packages: Sequence[str]) -> None:
    """Compile the stale modules of `packages` (top-level names) in a child process (see the
    module's docstring); blocking, so call it on a worker thread."""
    if sys.dont_write_bytecode or not sys.executable or getattr(sys, "frozen", False):
        return  # no interpreter to start (an embedding host's, a frozen app's is the app): imports compile
    stale = [str(root) for root in _roots(packages) if any(_stale(source) for source in root.rglob("*.py"))]
    if stale:
        flags = ["-" + "O" * sys.flags.optimize] if sys.flags.optimize else []  # the caches it reads
        if sys.pycache_prefix:
            flags += ["-X", f"pycache_prefix={sys.pycache_prefix}"]
        subprocess.run(
            [sys.executable, *flags, "-m", "compileall", "-q", *stale],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,  # a cache it cannot write is compiled at import, as without it
        )


def _roots(packages: Sequence[str]) -> list[Path]:
    found = (importlib.util.find_spec(name) for name in packages)
    return [
        Path(spec.submodule_search_locations[0]) for spec in found if spec and spec.submodule_search_locations
    ]


def _stale(source: Path) -> bool:
    """A module whose cache an import would not use (missing, or its header naming another
    source's mtime or size: what the import compares, not the files' mtimes), where the child
    could write one (a read-only checkout's stale modules would start a child at every run that
    writes nothing)."""
    cache = Path(importlib.util.cache_from_source(str(source)))
    try:
        with cache.open("rb") as file:
            header = file.read(16)
        stat = source.stat()
    except OSError:
        pass  # no cache yet: stale, where one can be written
    else:
        if header[:4] == importlib.util.MAGIC_NUMBER and header[4:8] != bytes(4):
            return False  # a hash-based cache: the import checks it, or trusts it, itself
        if header == _header(stat):
            return False
    folder = cache.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder.is_dir() and os.access(folder, os.W_OK)


def _header(source: os.stat_result) -> bytes:
    """A timestamp-based cache's first 16 bytes for a source of this mtime and size."""
    fields = (0, int(source.st_mtime), source.st_size)
    return importlib.util.MAGIC_NUMBER + b"".join((f & 0xFFFFFFFF).to_bytes(4, "little") for f in fields)


def say(message: str, *args: object) -> None:
    """One line of what start-up is doing now (see the module's docstring)."""
    logging.getLogger(NARRATION).info(message, *args)
