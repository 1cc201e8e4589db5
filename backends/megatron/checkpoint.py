"""The megatron backend's files in a checkpoint, written through megatron's `dist_checkpointing`.

`save(state, directory)` writes a sharded state dict (the model's and the optimizer's, each rank
its own shards) into `directory`, synchronously, and refuses a state holding NaN or infinity
(`NonFiniteState`; each rank checks its own shards: a pipeline process is one rank); a write that
fails (a full disk) is an `OSError` naming the folder and the free space. An
asynchronous checkpoint passes it a copy in host memory, `HostCopier.copy(state, leaf=sharded_leaf)`.
`load(state, directory)` reads one back, resharding to the current tensor-parallel layout, into
fresh tensors (the live ones in `state` are left as they were) and returns it as plain state
dicts, verified finite: files missing, torn or not finite raise `DamagedState`.

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

import dataclasses
import queue
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
from torch.distributed.checkpoint.api import CheckpointException

from backends.torch.state_file import nonfinite, write_failed
from pipeline.contracts.errors import DamagedState, NonFiniteState

_SHARDED = (ShardedTensor, ShardedTensorFactory)


def save(state: dict[str, Any], directory: Path) -> None:
    where = nonfinite({v.key: v.data for v in nested_values(state) if isinstance(v, _SHARDED)})
    # Every rank refuses together: one that refused alone would leave the others waiting in
    # dist_checkpointing's collectives.
    if _any_rank(where is not None):
        where = where or "another tensor-parallel rank's shards"
        raise NonFiniteState(f"{directory.name}/ would hold non-finite values at {where}")
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    torch_strategy._logged_mcore_async_deprecation = True
    directory.mkdir(exist_ok=True)  # every rank writes its shards here
    try:
        dist_checkpointing.save(state, str(directory))
    except CheckpointException as error:
        # Its writer threads' failures (a full disk, a missing psutil) come back as one
        # BaseException for the "write" phase; a failure to plan the save is a bug.
        if error.args[0] != "write":
            raise
        raise write_failed(directory, _first_failure(error)) from None


def _first_failure(error: CheckpointException) -> str:
    """The first failing rank's error, in one line (only the coordinating rank holds them)."""
    for failure, _ in error.failures.values():
        return " ".join(f"{type(failure).__name__}: {failure}".split())
    return "another rank's write failed"


def sharded_leaf(value: Any, copy: Callable[[Any], Any]) -> Any:
    """For `HostCopier.copy` of a sharded state: a shard description with its data copied."""
    if isinstance(value, (*_SHARDED, ShardedObject)):
        return dataclasses.replace(value, data=copy(value.data))
    return NotImplemented


def load(state: dict[str, Any], directory: Path) -> dict[str, Any]:
    if not directory.is_dir():
        raise DamagedState(f"{directory.name}/ is missing")

    def fresh(value: Any) -> Any:
        return (
            dataclasses.replace(value, data=torch.empty_like(value.data))
            if isinstance(value, _SHARDED)
            else value
        )

    template = dict_list_map_inplace(fresh, state)
    problem = None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            warnings.filterwarnings("ignore", "The argument order of load has been changed")
            warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)
            loaded = dist_checkpointing.load(template, str(directory))
    # megatron and torch report a missing or torn shard many ways; torch's CheckpointException
    # (what a torn shard raises) is a BaseException.
    except (Exception, CheckpointException) as error:
        problem = f"does not load: {type(error).__name__}: {error}"
    else:
        where = nonfinite(loaded)
        if where is not None:
            problem = f"holds non-finite values at {where}"
    # Every rank refuses together (the trainer's next collective would wait on one that did alone).
    if _any_rank(problem is not None):
        raise DamagedState(f"{directory.name}/ {problem or 'does not load on another tensor-parallel rank'}")
    return loaded


def _any_rank(flag: bool) -> bool:
    """`flag` of any rank of the world (every rank calls it at the same point)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return flag
    cuda = torch.distributed.get_backend() == "nccl"
    vote = torch.tensor(
        [int(flag)], device=torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu"
    )
    torch.distributed.all_reduce(vote, op=torch.distributed.ReduceOp.MAX)
    return bool(vote.item())
