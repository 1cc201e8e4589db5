"""The megatron backend's files in a checkpoint, written through megatron's `dist_checkpointing`.

`save(state, directory)` writes a sharded state dict (the model's and the optimizer's, each rank
its own shards) into `directory`, synchronously, and `load(state, directory)` fills one back,
resharding to the current tensor-parallel layout.

dist_checkpointing's writer reports its results through a queue it creates once per process
from a spawned `multiprocessing` manager (a fresh interpreter: 14 s on the 2-core CPU machine,
and `__main__` must be import-safe). A synchronous save writes in this process, where a plain
queue serves as well, so `save` installs one.
"""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async


def save(state: dict[str, Any], directory: Path) -> None:
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    directory.mkdir()
    dist_checkpointing.save(state, str(directory))


def load(state: dict[str, Any], directory: Path) -> dict[str, Any]:
    return dist_checkpointing.load(state, str(directory))
