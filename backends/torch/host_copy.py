"""Host copies of a nested training state, into one buffer reused from snapshot to snapshot.

`HostCopier.copy(state)` returns `state` with every container (dict, list, tuple) rebuilt and
every tensor replaced by a copy in host memory, so the copy stays as it was while training
changes the live state: what an asynchronous checkpoint writes (`Snapshotting`). Tensors that
are the same view of the same storage (tied weights) are copied once and stay shared.

The copies live in one byte buffer (`arena`), allocated once and reused by every later copy of
the same or a smaller state; it grows (a new buffer) only when a state needs more. With any
tensor on a GPU it is pinned (page-locked) memory, pinned once because pinning is slow, and the
copies into it are asynchronous, each device synchronized once at the end. Each returned tensor
is a view of the arena through storage of its own (exactly its bytes), so `torch.save` writes it
as it writes a tensor of its own, never the whole arena.

A fresh arena is slow to fill: the kernel gives its pages on first touch (zeroing each), a copy
from a GPU into memory that is not pinned goes through the driver's staging buffer, and pinning
takes seconds a GB: together, many seconds for a large model's state, inside the step that saves.
`reserve(state)` does all of that ahead, off the caller's path: on a thread of its own it
allocates the arena for `state`'s size, touches every page and pins it (GPU states), and the
next `copy` waits only for what is left of it. Without a reservation a new arena takes its first
copy pageable and is pinned on a thread of its own meanwhile (the next copy waits for that).

Lifecycle: a copy's tensors alias the arena until the next `copy`, which overwrites them: the
caller writes (or drops) one copy before taking the next (`Snapshotting` guarantees it). A
copy holds a reference to its arena, so an arena replaced by a larger one lives as long as
copies of it do.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("backends.torch.host_copy")

_ALIGN = 64  # every copy starts on a cache line: views of any dtype are aligned


Leaf = Callable[[Any, Callable[[Any], Any]], Any]


class HostCopier:
    def __init__(self) -> None:
        self.arena: torch.Tensor | None = None
        self._for_gpu = False  # the arena takes copies from a GPU (and is pinned once)
        self._pinning: threading.Thread | None = None  # pins, or prepares a reserved arena
        self._tried: torch.Tensor | None = None  # the arena pinned (or tried)
        self.allocations = 0  # arenas allocated (each one pinned on GPU: slow)

    def reserve(self, state: Any, leaf: Leaf | None = None) -> None:
        """Prepare, on a thread of its own, an arena for a later `copy` of `state` (or of a
        state of its size): allocated, every page touched, pinned when `state` is on a GPU.
        Returns at once; nothing to do when the arena already holds it."""
        _, nbytes, cuda = _plan(state, leaf)
        if self._pinning is not None and self._pinning.is_alive():
            return  # a reservation (or pinning) is under way: the next copy waits for it
        self.wait()
        arena = self.arena
        if arena is not None and arena.numel() >= nbytes and self._for_gpu == cuda:
            return
        self.arena, self._for_gpu = None, cuda  # the old arena goes once no copy holds it
        self._pinning = threading.Thread(
            target=self._prepare, args=(nbytes, cuda), name="reserve-snapshot", daemon=True
        )
        self._pinning.start()

    def _prepare(self, nbytes: int, pinned: bool) -> None:
        start = time.perf_counter()
        arena = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        arena.zero_()  # every page given now (the kernel zeroes each on first touch), not in a copy
        touched = time.perf_counter()
        if pinned:
            _pin(arena)
        log.debug(
            "reserved %.2f GB for snapshots: touched in %.3f s, pinned in %.3f s",
            nbytes / 1e9,
            touched - start,
            time.perf_counter() - touched,
        )
        self._tried = arena
        self.arena = arena
        self.allocations += 1

    def copy(self, state: Any, leaf: Leaf | None = None) -> Any:
        """`state` copied to host memory (see the module docstring). `leaf(value, copy)` may
        copy a type of its own (returning NotImplemented for the rest), with `copy` for values
        inside it."""
        began = time.perf_counter()
        tensors, offset, gpu = _plan(state, leaf)
        cuda = [t.device for t, _ in tensors.values() if t.device.type == "cuda"]
        arena = self._arena(offset, pinned=gpu)
        ready = time.perf_counter()
        copies: dict[tuple[Any, ...], torch.Tensor] = {}
        with torch.no_grad():
            for k, (tensor, start) in tensors.items():
                nbytes = tensor.numel() * tensor.element_size()
                view = arena[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
                view.copy_(tensor.detach(), non_blocking=bool(cuda))
                copies[k] = _own_storage(view, arena)
        for device in set(cuda):
            torch.cuda.synchronize(device)
        log.debug(
            "host copy of %.2f GB: %.3f s for its buffer, %.3f s to copy (%s)",
            offset / 1e9,
            ready - began,
            time.perf_counter() - ready,
            ("pinned" if self._tried is arena else "pageable") if cuda else "host to host",
        )
        if cuda and self._tried is not arena:
            # Pinning takes seconds a GB: a new arena takes its first copy pageable, and is
            # pinned beside the steps that follow, for the next copies.
            self._tried = arena
            self._pinning = threading.Thread(target=_pin, args=(arena,), name="pin-snapshot", daemon=True)
            self._pinning.start()

        def fill(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return copies[_key(value)]
            return rebuild(value, fill, leaf)

        return fill(state)

    def wait(self) -> None:
        """Wait for the reservation or the pinning under way, if any."""
        if self._pinning is not None:
            self._pinning.join()
            self._pinning = None

    def _arena(self, nbytes: int, *, pinned: bool) -> torch.Tensor:
        self.wait()  # the arena is not written while it is being prepared or pinned
        arena = self.arena
        if arena is None or arena.numel() < nbytes or self._for_gpu != pinned:
            arena = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            self.arena, self._for_gpu = arena, pinned
            self.allocations += 1
        return arena


def _key(tensor: torch.Tensor) -> tuple[Any, ...]:
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.dtype,
    )


def _plan(state: Any, leaf: Leaf | None) -> tuple[dict[tuple[Any, ...], tuple[torch.Tensor, int]], int, bool]:
    """Each distinct tensor of `state` (by `_key`) with its offset in an arena, the arena's
    size, and whether any tensor is on a GPU."""
    tensors: dict[tuple[Any, ...], tuple[torch.Tensor, int]] = {}
    offset = 0

    def collect(value: Any) -> Any:
        nonlocal offset
        if isinstance(value, torch.Tensor):
            k = _key(value)
            if k not in tensors:
                tensors[k] = (value, offset)
                offset += -(-value.numel() * value.element_size() // _ALIGN) * _ALIGN
            return value
        return rebuild(value, collect, leaf)

    collect(state)
    return tensors, offset, any(t.device.type == "cuda" for t, _ in tensors.values())


def rebuild(value: Any, each: Callable[[Any], Any], leaf: Callable[..., Any] | None = None) -> Any:
    """`value`'s containers (dict, list, tuple; not named tuples) rebuilt, `each` applied to what
    they hold; `leaf(value, each)` may rebuild a type of its own (NotImplemented for the rest)."""
    if leaf is not None:
        done = leaf(value, each)
        if done is not NotImplemented:
            return done
    if isinstance(value, dict):
        rebuilt = OrderedDict if isinstance(value, OrderedDict) else dict
        out = rebuilt((k, each(v)) for k, v in value.items())
        metadata = getattr(value, "_metadata", None)  # a module state dict's versions
        if metadata is not None:
            out._metadata = metadata  # type: ignore[attr-defined]
        return out
    if isinstance(value, list):
        return [each(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(each(v) for v in value)
    return value


def _pin(buffer: torch.Tensor) -> None:
    """Page-lock `buffer` for asynchronous copies from any GPU, until it is freed. Registered
    rather than allocated pinned (`pin_memory=True`): the caching host allocator rounds a
    pinned allocation up to a power of two, nearly twice a large state's size (torch's own
    asynchronous checkpoint staging registers its buffers the same way). A failure leaves it
    pageable: copies into it are then slower, not wrong."""
    cudart = torch.cuda.cudart()
    pointer = buffer.data_ptr()
    status = int(cudart.cudaHostRegister(pointer, buffer.numel(), 1))  # 1: cudaHostRegisterPortable
    if status != 0:
        log.warning(
            "pinning %d bytes for checkpoint snapshots failed (cudaError %d): copies stay pageable",
            buffer.numel(),
            status,
        )
        return
    weakref.finalize(buffer, cudart.cudaHostUnregister, pointer)


def _own_storage(view: torch.Tensor, arena: torch.Tensor) -> torch.Tensor:
    """`view` (contiguous, in `arena`) as a tensor whose storage is exactly its bytes, keeping
    `arena` alive while it lives."""
    nbytes = view.numel() * view.element_size()
    if nbytes == 0:
        return torch.empty(view.shape, dtype=view.dtype)
    window = (ctypes.c_char * nbytes).from_address(view.data_ptr())
    window._arena = arena  # type: ignore[attr-defined]
    return torch.frombuffer(window, dtype=view.dtype).view(view.shape)
