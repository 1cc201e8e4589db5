"""Float32 master weights for a low-precision model, and parking optimizer state on the host.

`MasterWeights`: AdamW steps float32 copies of bf16 parameters and the model gets them rounded
back. Stepping bf16 weights directly loses updates smaller than half a bf16 spacing (about 2e-3
of the weight): at the learning rates of RL fine-tuning (1e-6) that is nearly every update.
Gradients are clipped by their norm computed in float32 and converted one tensor at a time.

`HostParking`: moves a set of device tensors (master weights and optimizer moments) to pinned
host buffers allocated once, and frees their device storage in place, so the optimizer's state
dict and every reference stay valid; `restore` copies them back into the same tensors.
`StreamedParking` does this per chunk of parameters, and the trainer restores, steps and parks
one chunk after another: an 8B model's 96 GB of float32 masters and moments never need to be on
the device at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
from torch import Tensor


class MasterWeights:
    """`chunks`: index lists whose float32 gradients total at most `chunk_bytes`; the trainer
    converts and steps one chunk at a time, so the float32 gradients of the whole model never
    exist at once (4 bytes a parameter fewer at the step's peak)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], *, chunk_bytes: int = 1 << 30) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.master = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
        self.chunks: list[list[int]] = [[]]
        size = 0
        for i, p in enumerate(self.params):
            if self.chunks[-1] and size + 4 * p.numel() > chunk_bytes:
                self.chunks.append([])
                size = 0
            self.chunks[-1].append(i)
            size += 4 * p.numel()

    def grad_norm(self) -> float:
        """The float32 2-norm of all the model's gradients (inf/nan when one is not finite)."""
        norms = [
            torch.linalg.vector_norm(p.grad, dtype=torch.float32) for p in self.params if p.grad is not None
        ]
        if not norms:
            return 0.0
        return float(torch.linalg.vector_norm(torch.stack(norms)))

    def load_grads(self, scale: float, chunk: list[int]) -> None:
        """master.grad = scale * model grad in float32 for `chunk`; those model grads are freed."""
        for i in chunk:
            p, m = self.params[i], self.master[i]
            if p.grad is None:
                m.grad = None
                continue
            m.grad = p.grad.float().mul_(scale)
            p.grad = None

    @torch.no_grad()
    def publish(self, chunk: list[int]) -> None:
        """Round `chunk`'s master weights into the model; drop their master gradients."""
        for i in chunk:
            self.params[i].copy_(self.master[i])
            self.master[i].grad = None

    @torch.no_grad()
    def reload_from_model(self) -> None:
        for p, m in zip(self.params, self.master, strict=True):
            m.copy_(p)


class HostParking:
    """Device tensors parked in pinned host memory between uses; buffers are allocated once."""

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []
        self.host: list[Tensor] = []
        self._by_id: dict[int, Tensor] = {}
        self.parked = False

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @torch.no_grad()
    def park(self, tensors: list[Tensor]) -> float:
        """Copy `tensors` to the host and free their device storage; returns the seconds taken."""
        if self.parked:
            raise RuntimeError("already parked")
        start = time.perf_counter()
        hosts = []
        for t in tensors:  # a tensor parked before keeps its buffer: each is pinned once
            host = self._by_id.get(id(t))
            if host is None or host.shape != t.shape or host.dtype != t.dtype:
                if t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
                    raise ValueError("only tensors that own their whole storage can be parked")
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            hosts.append(host)
        self.tensors, self.host = tensors, hosts
        self._by_id = {id(t): h for t, h in zip(tensors, hosts, strict=True)}
        for tensor, host in zip(self.tensors, self.host, strict=True):
            host.copy_(tensor, non_blocking=True)
        if self.tensors and self.tensors[0].is_cuda:
            torch.cuda.synchronize()
        for tensor in self.tensors:
            tensor.untyped_storage().resize_(0)
        if self.tensors and self.tensors[0].is_cuda:
            torch.cuda.empty_cache()  # the engine's KV cache may take the freed memory
        self.parked = True
        return time.perf_counter() - start

    def host_copy(self, tensor: Tensor) -> Tensor:
        """The parked contents of `tensor` (itself when not parked)."""
        if self.parked:
            return self._by_id.get(id(tensor), tensor)
        return tensor

    def forget(self) -> None:
        """Drop the (restored) tensors and host buffers: the caller replaced them."""
        if self.parked:
            raise RuntimeError("restore before forgetting")
        self.tensors, self.host, self._by_id = [], [], {}

    @torch.no_grad()
    def restore(self) -> float:
        """Give the parked tensors their device storage and contents back; returns the seconds."""
        if not self.parked:
            return 0.0
        start = time.perf_counter()
        for tensor, host in zip(self.tensors, self.host, strict=True):
            tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
            tensor.copy_(host, non_blocking=True)
        if self.tensors and self.tensors[0].is_cuda:
            torch.cuda.synchronize()
        self.parked = False
        return time.perf_counter() - start


class StreamedParking:
    """Optimizer state parked on the host in chunks, and streamed through the device one chunk
    at a time while the optimizer steps: the device never holds more than one chunk of it.

    `tensors_of(chunk)` lists what a chunk parks (its master weights and their Adam moments,
    which AdamW creates at its first step). Each chunk has its own `HostParking`, so every
    pinned buffer is still allocated once.
    """

    def __init__(self, chunks: list[list[int]], tensors_of: Callable[[list[int]], list[Tensor]]) -> None:
        self.chunks = chunks
        self.tensors_of = tensors_of
        self.parkings = [HostParking() for _ in chunks]
        self.moved_s = {"reload": 0.0, "offload": 0.0}

    @property
    def parked(self) -> bool:
        return all(p.parked for p in self.parkings)

    @property
    def bytes(self) -> int:
        return sum(p.bytes for p in self.parkings)

    def park(self, index: int) -> None:
        self.moved_s["offload"] += self.parkings[index].park(self.tensors_of(self.chunks[index]))

    def restore(self, index: int) -> None:
        self.moved_s["reload"] += self.parkings[index].restore()

    def park_all(self) -> None:
        for index in range(len(self.chunks)):
            self.park(index)

    def restore_all(self) -> None:
        for index in range(len(self.chunks)):
            self.restore(index)

    def take_seconds(self) -> dict[str, float]:
        """Seconds spent copying in and out since the last call."""
        seconds, self.moved_s = self.moved_s, {"reload": 0.0, "offload": 0.0}
        return seconds

    def host_copy(self, tensor: Tensor) -> Tensor:
        """The parked contents of `tensor` (itself when not parked)."""
        for parking in self.parkings:
            copy = parking.host_copy(tensor)
            if copy is not tensor:
                return copy
        return tensor

    def forget(self) -> None:
        for parking in self.parkings:
            parking.forget()
