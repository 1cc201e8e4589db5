"""The megatron backend's files in a checkpoint, written through megatron's `dist_checkpointing`.

`save(state, directory)` writes a sharded state dict (the model's and the optimizer's, each rank
its own shards) into `directory`, synchronously, and `load(state, directory)` fills one back,
resharding to the current tensor-parallel layout.

Three things megatron 0.19 does on these paths are quieted or replaced here, each for a reason:
  * its writer reports results through a queue it creates once per process from a spawned
    `multiprocessing` manager (a fresh interpreter: 14 s on the 2-core CPU machine, and
    `__main__` must be import-safe); a synchronous save writes in this process, where a plain
    queue serves as well;
  * its synchronous save runs through its own async machinery, which logs once that "MCore's
    async save is deprecated": nothing here saves asynchronously;
  * its load reads each rank's shards itself and tells torch so (`no_dist=True`), passing
    torch's arguments by position; torch answers each with a warning at every load.
"""

from __future__ import annotations

import queue
import warnings
from pathlib import Path
from typing import Any

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies import torch as torch_strategy


def save(state: dict[str, Any], directory: Path) -> None:
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    torch_strategy._logged_mcore_async_deprecation = True
    directory.mkdir()
    dist_checkpointing.save(state, str(directory))


def load(state: dict[str, Any], directory: Path) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        warnings.filterwarnings("ignore", "The argument order of load has been changed")
        warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)
        return dist_checkpointing.load(state, str(directory))
