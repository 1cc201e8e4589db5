"""Data parallelism for the torch trainer (`train.data_parallel`): replicated weights, summed
gradients, and the optimizer state sharded over the ranks (ZeRO stage 1).

Every rank holds the whole model (what a colocated engine replica on that rank serves in place)
and trains its share of each minibatch (`pipeline.algorithms.update`). After the backward
passes `sum_gradients` sums every gradient over the ranks, so each rank holds the gradient of
the whole minibatch and computes the same norm and clip. Each parameter has one owner rank
(`owners`: whole parameters, balanced by size): only the owner keeps that parameter's AdamW
moments (and float32 master copy) and steps it; `share_owned` then broadcasts each rank's
updated parameters to the others. So an 8B model's 12 bytes a parameter of optimizer state
are spread over the ranks, and the update equals one rank's AdamW on the whole minibatch.

Why not FSDP2 (`fully_shard`): it shards the parameters themselves, which the colocated engine
reads in place (it would have to gather them at every wake), and its reduce-scatter is not
available over gloo, which the CPU runs and tests use.

`RankGroup` is the collectives this needs, over torch.distributed's default group (one Ray
actor a rank: `backends/ray/world.py`) or over a gloo process group object (tests: ranks as
threads of one process).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from pipeline.algorithms.update import DataParallel

BUCKET_ELEMENTS = 1 << 26  # per flattened collective: bounds the extra copy it makes


@dataclass(frozen=True)
class RankGroup:
    """This process's (or thread's) rank of `size`; `all_sum(t)` sums `t` over the ranks in
    place, `broadcast(t, root)` overwrites `t` with rank `root`'s."""

    rank: int
    size: int
    all_sum: Callable[[torch.Tensor], None]
    broadcast: Callable[[torch.Tensor, int], None]

    @classmethod
    def world(cls) -> RankGroup:
        """The default process group, which this process joined as one rank."""
        import torch.distributed as dist

        return cls(
            rank=dist.get_rank(),
            size=dist.get_world_size(),
            all_sum=lambda t: dist.all_reduce(t),
            broadcast=lambda t, root: dist.broadcast(t, src=root),
        )

    @classmethod
    def of(cls, group: Any, *, rank: int, size: int) -> RankGroup:
        """A gloo process-group object (`torch.distributed.ProcessGroupGloo`)."""
        return cls(
            rank=rank,
            size=size,
            all_sum=lambda t: group.allreduce([t]).wait(),
            broadcast=lambda t, root: group.broadcast(t, root).wait(),
        )

    def for_update(self) -> DataParallel:
        """What the update loop needs of the ranks."""
        return DataParallel(rank=self.rank, size=self.size, all_sum=self.all_sum)


def owners(params: Sequence[torch.Tensor], size: int) -> list[int]:
    """Each parameter's owner rank: whole parameters, the largest first to the rank holding the
    fewest elements so far (ties to the lowest rank). The same on every rank."""
    load = [0] * size
    owner = [0] * len(params)
    for index in sorted(range(len(params)), key=lambda i: -params[i].numel()):  # stable
        rank = min(range(size), key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += params[index].numel()
    return owner


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` in runs of one dtype and at most `BUCKET_ELEMENTS` elements (one flattened
    collective each; a larger tensor alone)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        last = buckets[-1] if buckets else None
        if last is None or last[0].dtype != tensor.dtype or size + tensor.numel() > BUCKET_ELEMENTS:
            buckets.append([tensor])
            size = tensor.numel()
        else:
            last.append(tensor)
            size += tensor.numel()
    return buckets


@torch.no_grad()
def sum_gradients(params: Sequence[torch.nn.Parameter], group: RankGroup) -> None:
    """Every parameter's gradient summed over the ranks, in place (a rank that trained no group
    of this minibatch adds zeros)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for bucket in _buckets([p.grad for p in params if p.grad is not None]):
        flat = _flatten_dense_tensors(bucket)
        group.all_sum(flat)
        for grad, summed in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            grad.copy_(summed)


@torch.no_grad()
def share_owned(params: Sequence[torch.nn.Parameter], owner: Sequence[int], group: RankGroup) -> None:
    """Each rank's updated parameters, broadcast from it to every other rank."""
    for root in range(group.size):
        for bucket in _buckets([p.data for p, o in zip(params, owner, strict=True) if o == root]):
            flat = _flatten_dense_tensors(bucket)
            group.broadcast(flat, root)
            if root != group.rank:
                for param, value in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                    param.copy_(value)


def grad_norm(params: Sequence[torch.nn.Parameter]) -> float:
    """The float32 2-norm of all the parameters' gradients (as `clip_grad_norm_` and the master
    weights compute it)."""
    norms = [torch.linalg.vector_norm(p.grad, dtype=torch.float32) for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
