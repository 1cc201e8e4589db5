"""The `collective` weights transport, on the actors' side: one torch.distributed process group
of the trainer (rank 0) and every engine replica (ranks 1..N), and a version's weights
broadcast in it.

Group lifecycle (driven by the controller, `backends/ray/collective.py`): the trainer `open`s a
rendezvous, a TCP store on its node's IP at a port the OS picks, and every member `join`s it,
each first leaving the group it was in; a new group is built whenever the membership changes
(a replica replaced). NCCL when the actors hold CUDA devices (one rank per GPU), gloo on CPU.

A refit: rank 0 broadcasts a `Header` (version; every tensor's name, shape, dtype), every
replica checks it as `unpack` checks a package, and all vote (an all-reduce of the minimum):
the payload follows only if every replica accepted, so a refused header fails the refit on the
replicas, before anything is copied, and leaves no rank waiting in a broadcast the others skip.
The payload: the tensors flattened into `Buckets` of one dtype, at most `BUCKET_BYTES` each (a
larger tensor alone), one broadcast per bucket. A replica receives into buckets of its own and
the engine copies them into its parameters between two decode loops, so it never samples from
half-received weights. The trainer keeps its last buckets (one copy of the weights): they are
the package a replica started between two refits loads (`Buckets.package`), while the trainer
already trains the next step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from backends.ray.weights import Header, Package, WeightsMismatch, check, header
from backends.ray.world import init

BUCKET_BYTES = 256 << 20


class Group:
    """This actor's membership: at most one group at a time; the trainer's also holds the store."""

    def __init__(self) -> None:
        self.store: dist.TCPStore | None = None

    def open(self, timeout_s: float) -> tuple[str, int]:
        import ray

        self.leave()
        host = ray.util.get_node_ip_address()
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        return host, self.store.port

    def join(self, address: tuple[str, int], rank: int, world: int, backend: str, timeout_s: float) -> None:
        """Join the group `address` (the trainer's `open`) as `rank`; a collective that waits
        longer than `timeout_s` on a member (it died) fails."""
        if rank != 0:
            self.leave()
            self.store = dist.TCPStore(*address, is_master=False, timeout=timedelta(seconds=timeout_s))
        init(self.store, rank=rank, size=world, backend=backend, timeout_s=timeout_s)

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.store = None


@dataclass(frozen=True)
class Buckets:
    header: Header
    buffers: list[torch.Tensor]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Views of the buffers, one per tensor of the header."""
        views = {}
        for (_, indices), buffer in zip(layout(self.header), self.buffers, strict=True):
            offset = 0
            for i in indices:
                name, shape, _ = self.header.specs[i]
                views[name] = buffer[offset : offset + math.prod(shape)].view(shape)
                offset += math.prod(shape)
        return views

    def package(self, version: int) -> Package:
        """An object-store package of these weights, for a replica outside the group."""
        assert version == self.header.version, f"kept weights of {self.header.version}, asked for {version}"
        return Package(
            version, "object_store", {n: t.to("cpu", copy=True) for n, t in self.tensors().items()}
        )


def layout(sent: Header) -> list[tuple[torch.dtype, list[int]]]:
    """The buckets of a header's tensors: (dtype, indices into `specs`), in order, each at most
    `BUCKET_BYTES` unless one tensor alone is larger. Sender and receivers derive the same."""
    buckets = []
    for dtype in dict.fromkeys(spec[2] for spec in sent.specs):
        bucket: list[int] = []
        size = 0
        for i, (_, shape, of) in enumerate(sent.specs):
            if of != dtype:
                continue
            nbytes = math.prod(shape) * dtype.itemsize
            if bucket and size + nbytes > BUCKET_BYTES:
                buckets.append((dtype, bucket))
                bucket, size = [], 0
            bucket.append(i)
            size += nbytes
        buckets.append((dtype, bucket))
    return buckets


@torch.no_grad()
def bucketed(version: int, parameters: list[tuple[str, torch.Tensor]]) -> Buckets:
    """A copy of `parameters` as `version`'s buckets (on the trainer's compute thread)."""
    sent = header(version, parameters)
    tensors = [t.detach() for _, t in parameters]
    buffers = [torch.cat([tensors[i].reshape(-1) for i in indices]) for _, indices in layout(sent)]
    _settled(buffers[0].device)
    return Buckets(sent, buffers)


def send(buckets: Buckets) -> None:
    """Rank 0: the header, the vote, then (if every replica accepted) the payload."""
    device = buckets.buffers[0].device
    dist.broadcast_object_list([buckets.header], src=0, device=device)
    if _all_accept(True, device):
        for buffer in buckets.buffers:
            dist.broadcast(buffer, src=0)


def receive(version: int, like: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A replica: the header, checked against the announced `version` and its own parameters
    `like`, the vote, then the payload into new buckets; the tensors by name."""
    device = like[0][1].device
    box: list[Header | None] = [None]
    dist.broadcast_object_list(box, src=0, device=device)
    sent = box[0]
    assert sent is not None
    refused: WeightsMismatch | None = None
    try:
        check(sent, version=version, like=like)
    except WeightsMismatch as error:
        refused = error
    if not _all_accept(refused is None, device):
        raise refused or WeightsMismatch(f"weights of version {sent.version}: another replica refused them")
    buffers = [
        torch.empty(sum(math.prod(sent.specs[i][1]) for i in indices), dtype=dtype, device=device)
        for dtype, indices in layout(sent)
    ]
    for buffer in buffers:
        dist.broadcast(buffer, src=0)
    _settled(device)
    return Buckets(sent, buffers).tensors()


def _all_accept(accepted: bool, device: torch.device) -> bool:
    vote = torch.tensor([int(accepted)], device=device)
    dist.all_reduce(vote, op=dist.ReduceOp.MIN)
    return bool(vote.item())


def _settled(device: torch.device) -> None:
    """Buffers written on this thread's stream are read on another thread's (the broadcast's,
    the engine's copy): wait for them here rather than rely on both using one stream."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
