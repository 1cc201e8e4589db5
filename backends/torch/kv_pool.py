"""Device memory for a KV cache that can be handed back to the driver and taken again at the
same virtual address, so CUDA graphs captured over it stay valid across a colocated handoff.

`KVPool.allocate(nbytes)` returns a flat uint8 tensor. `release()` frees the physical memory
(the tensor must not be touched until `restore()`); `restore()` maps fresh physical memory
at the same addresses (contents are undefined afterwards). `stable` says whether addresses
survive a release/restore cycle:

- `VirtualMemoryPool` (CUDA, through the driver's virtual memory API from `cuda-bindings`):
  reserves an address range once, then maps and unmaps physical memory under it. Stable.
- `PlainPool` (any device, or CUDA without `cuda-bindings`): `torch.empty` on restore. Not
  stable: whoever captured graphs over the old tensor must capture them again.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class KVPool(Protocol):
    stable: bool

    def allocate(self, nbytes: int) -> torch.Tensor: ...
    def release(self) -> None: ...
    def restore(self) -> torch.Tensor: ...
    def free(self) -> None: ...
    @property
    def resident_bytes(self) -> int: ...


def make_pool(device: torch.device) -> KVPool:
    if device.type == "cuda":
        try:
            return VirtualMemoryPool(device)
        except ImportError:
            pass
    return PlainPool(device)


class PlainPool:
    stable = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.nbytes = 0
        self.buffer: torch.Tensor | None = None

    def allocate(self, nbytes: int) -> torch.Tensor:
        self.free()
        self.nbytes = nbytes
        return self.restore()

    def release(self) -> None:
        self.buffer = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def restore(self) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        return self.buffer

    def free(self) -> None:
        self.release()
        self.nbytes = 0

    @property
    def resident_bytes(self) -> int:
        return 0 if self.buffer is None else self.nbytes


class _ArrayInterface:
    """Lets `torch.as_tensor` view raw device memory without copying or owning it."""

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (pointer, False),
            "version": 3,
            "strides": None,
        }


class VirtualMemoryPool:
    """One reserved virtual address range; physical memory is mapped under it while resident."""

    stable = True

    def __init__(self, device: torch.device) -> None:
        from cuda.bindings import driver

        self._cu: Any = driver
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.index
        self._prop = prop
        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.index
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = access
        self.nbytes = 0
        self.reserved = 0
        self._pointer = 0
        self._handle: Any = None
        self._view: torch.Tensor | None = None

    def _call(self, name: str, *args: Any) -> Any:
        result = getattr(self._cu, name)(*args)
        error = result[0]
        if error != self._cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{name} failed: {error}")
        return result[1] if len(result) == 2 else result[1:]

    def _bind_context(self) -> None:
        # Worker threads may have no current context for the driver API yet.
        torch.cuda.set_device(self.index)
        torch.cuda.synchronize(self.index)

    def allocate(self, nbytes: int) -> torch.Tensor:
        self.free()
        self._bind_context()
        granularity = self._call(
            "cuMemGetAllocationGranularity",
            self._prop,
            self._cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
        self.nbytes = nbytes
        self.reserved = -(-nbytes // granularity) * granularity
        self._pointer = int(self._call("cuMemAddressReserve", self.reserved, 0, 0, 0))
        return self.restore()

    def restore(self) -> torch.Tensor:
        if self._handle is None:
            self._bind_context()
            try:
                self._handle = self._call("cuMemCreate", self.reserved, self._prop, 0)
            except RuntimeError:
                torch.cuda.empty_cache()  # the trainer's cached blocks may hold what we need
                self._handle = self._call("cuMemCreate", self.reserved, self._prop, 0)
            self._call("cuMemMap", self._pointer, self.reserved, 0, self._handle, 0)
            self._call("cuMemSetAccess", self._pointer, self.reserved, [self._access], 1)
        if self._view is None:
            view = torch.as_tensor(_ArrayInterface(self._pointer, self.nbytes), device=self.device)
            assert view.data_ptr() == self._pointer
            self._view = view
        return self._view

    def release(self) -> None:
        if self._handle is None:
            return
        self._bind_context()  # nothing may still read the cache when it is unmapped
        self._call("cuMemUnmap", self._pointer, self.reserved)
        self._call("cuMemRelease", self._handle)
        self._handle = None

    def free(self) -> None:
        self.release()
        self._view = None
        if self.reserved:
            self._call("cuMemAddressFree", self._pointer, self.reserved)
        self.reserved = self.nbytes = self._pointer = 0

    @property
    def resident_bytes(self) -> int:
        return 0 if self._handle is None else self.reserved
