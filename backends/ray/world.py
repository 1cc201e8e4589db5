"""The trainer's tensor-parallel ranks (`train.tensor_parallel`) as one torch.distributed world
of Ray actors, one actor a rank.

The controller holds the rendezvous for the whole run (`rendezvous`: a TCP store on its node,
at a port the OS picks; megatron's groups are built through it). Each rank's actor joins it
(`join`) as it starts, before it builds its part of the trainer: NCCL where the actors hold
CUDA devices (one rank a GPU), gloo on CPU. A rank that waits longer than `timeout_s` on
another (one that died) fails its collective, which fails the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any


@dataclass(frozen=True)
class World:
    host: str
    port: int
    size: int
    backend: str  # "nccl" or "gloo"
    timeout_s: float


def rendezvous(size: int, backend: str, timeout_s: float) -> tuple[World, Any]:
    """The world's address and its store, which the controller keeps until the ranks are gone."""
    import ray
    import torch.distributed as dist

    host = ray.util.get_node_ip_address()
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
    return World(host, store.port, size, backend, timeout_s), store


def join(world: World, rank: int) -> None:
    """Make this process rank `rank` of `world` (blocks until every rank has joined)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=world.timeout_s)
    store = dist.TCPStore(world.host, world.port, is_master=False, timeout=timeout)
    init(store, rank=rank, size=world.size, backend=world.backend, timeout_s=world.timeout_s)


def init(store: Any, *, rank: int, size: int, backend: str, timeout_s: float) -> None:
    """torch.distributed's default group over `store`, bound to this process's GPU under NCCL."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device,
    )
