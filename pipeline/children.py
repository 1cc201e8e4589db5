"""The processes this one started, and theirs: what a second signal takes down with it.

A second SIGINT/SIGTERM exits at once (`os._exit`), skipping every clean-up, so whatever the
run started would outlive it: the Ray runtime of `placement.backend: ray` (its GCS, raylet,
agents and actors), a plot being drawn. `kill_descendants()` sends them SIGKILL first. Linux
reads the tree from /proc; elsewhere it does nothing.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every process below `pid` in the process tree, parents before their children."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        parent = int(stat.rpartition(")")[2].split()[1])  # after "pid (name) state"
        children.setdefault(parent, []).append(int(entry.name))
    found, frontier = [], [pid]
    while frontier:
        below = [child for parent in frontier for child in children.get(parent, [])]
        found.extend(below)
        frontier = below
    return found


def kill_descendants() -> None:
    for pid in descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # already gone
            pass
