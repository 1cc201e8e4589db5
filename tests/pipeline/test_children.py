"""The process tree below a process: what a second signal kills before it exits."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from pipeline.children import descendants


def test_descendants_are_the_children_and_their_children() -> None:
    # A subshell (a child) running sleep (a grandchild), beside a sleep of its own (a child).
    shell = subprocess.Popen(["bash", "-c", "(sleep 60; true) & sleep 60 & wait"])
    try:
        deadline = time.monotonic() + 120  # a hang guard: a loaded machine starts processes late
        while len(descendants(shell.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        names = sorted(Path(f"/proc/{pid}/comm").read_text().strip() for pid in descendants(shell.pid))
        assert names == ["bash", "sleep", "sleep"]
    finally:
        for pid in descendants(shell.pid):
            os.kill(pid, signal.SIGKILL)
        shell.kill()
        shell.wait()
