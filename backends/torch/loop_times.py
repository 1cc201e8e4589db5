"""Where a sampler's decode loops spend their time: running totals since the sampler was built.

A loop (`Sampler.serve`) queues work on the device and waits for it only at its checks, so
the wall time between two checks is the device's work queued between them. `LoopTimes` splits
a loop's wall time (`serve_s`) into what the device did and what it waited for:

- ``check_s``: the host's work at the checks once the device has caught up (handing finished
  rows over, asking the source, laying out the admitted rows): the device idles meanwhile;
- ``prefill_s``: the device time of admissions' prefills (and each row's first draw), timed
  by CUDA events read at the next check (no extra wait); on a CPU, the prefill's own time;
- the rest, ``serve_s - check_s - prefill_s``: decode steps (``decode_steps`` of them).

And ``wait_s``: how long the host waited at the checks for the device to catch up. Where the
device bounds the loop, the host launches a check's steps in a fraction of their device time and
waits out the rest: ``wait_s`` is most of the decode steps' time. Where the host bounds it (its
launches, or a thread holding the GIL), the device has caught up by the check: ``wait_s`` is
near 0 however fast the device's steps. On a CPU nothing is queued: near 0.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class LoopTimes:
    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self.decode_steps = 0
        self.serve_s = 0.0
        self.check_s = 0.0
        self.prefill_s = 0.0
        self.wait_s = 0.0
        self._prefill_began: torch.cuda.Event | float | None = None
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._check_began: float | None = None

    @contextmanager
    def loop(self) -> Iterator[None]:
        """One decode loop's wall time; a loop ends at a check, which ends with it."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.check_ends()
            self.serve_s += time.perf_counter() - began

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """The host waiting for the device's queued work (a check's read of its rows' state)."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.wait_s += time.perf_counter() - began

    def prefill_begins(self) -> None:
        if self._cuda:
            self._prefill_began = torch.cuda.Event(enable_timing=True)
            self._prefill_began.record()
        else:
            self._prefill_began = time.perf_counter()

    def prefill_ends(self) -> None:
        began, self._prefill_began = self._prefill_began, None
        if isinstance(began, torch.cuda.Event):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((began, end))
        else:
            assert began is not None, "a prefill ends after it begins"
            self.prefill_s += time.perf_counter() - began

    def check_begins(self) -> None:
        """The device has caught up (a check): the prefills queued so far are done, and the
        host's work from here on leaves it idle."""
        for start, end in self._pending:
            self.prefill_s += start.elapsed_time(end) / 1000
        self._pending.clear()
        self._check_began = time.perf_counter()

    def check_ends(self) -> None:
        """The check's work is done (nothing if none began since the last call)."""
        if self._check_began is not None:
            self.check_s += time.perf_counter() - self._check_began
            self._check_began = None
