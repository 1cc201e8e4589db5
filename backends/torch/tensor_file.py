"""A nested state's tensors as raw bytes in a file of their own, written in order, read by many threads.

`write_tensors(path, state)` writes every distinct tensor of `state` (dicts, lists, tuples
rebuilt; tensors that are the same view of the same storage, tied weights, written once) into
`path` at 64-byte aligned offsets, and returns the state with each tensor replaced by a
`StoredTensor` (its offset, dtype and shape): the skeleton, small, that the caller pickles
beside it. `read_tensors(path, skeleton)` gives the state back, each tensor a view of one buffer
read from the file (or, `mmap`, of the file mapped copy-on-write, read as it is used); a tied
tensor comes back as one tensor again.

Why not `torch.save` of the whole state: it pickles and writes each record holding the
interpreter lock, and its pages wait in the page cache until the kernel's dirty limits or the
fsync send them to the disk. Here the bytes go in file order, in pieces of `CHUNK`, by
`os.pwrite` (which releases the lock), and each piece's write-back to the disk is started as
soon as it is written (`sync_file_range` on Linux), so the disk writes while the rest is
copied and the checkpoint's fsync finds little left. In order, from one thread: pieces written
by many threads at once land on the disk out of order, and were slower on the GPU machine.
Reads, which need no order, run on many threads. The bytes of a tensor are its storage as it
is in memory (the machine's byte order): a file is read back on a machine of the same byte
order.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import torch

from backends.torch.host_copy import rebuild

CHUNK = 64 * 2**20  # bytes one thread writes or reads at a time
_ALIGN = 64
_THREADS = min(16, os.cpu_count() or 1)
_SYNC_FILE_RANGE_WRITE = 2  # start write-out of the range's dirty pages, do not wait


def _sync_file_range() -> Callable[..., int] | None:
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range  # ctypes releases the GIL
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]


_SYNC_FILE_RANGE = _sync_file_range()


class StoredTensor(NamedTuple):
    """Where a tensor's bytes lie in the tensor file, and what they hold."""

    offset: int
    dtype: str  # torch's name for it: "float32", "bfloat16", ...
    shape: tuple[int, ...]


def write_tensors(path: Path, state: Any) -> Any:
    """Write `state`'s tensors to `path` (see the module docstring); the skeleton."""
    stored: dict[tuple[Any, ...], tuple[torch.Tensor, StoredTensor]] = {}
    size = 0

    def place(tensor: torch.Tensor) -> StoredTensor:
        nonlocal size
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tensor.shape,
            tensor.stride(),
            tensor.dtype,
        )
        if key not in stored:
            entry = StoredTensor(size, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
            stored[key] = (tensor.detach(), entry)
            size += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
        return stored[key][1]

    skeleton = _each_leaf(state, torch.Tensor, place)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)  # the gaps between tensors read as zeros
        for tensor, entry in stored.values():  # in file order; one host copy at a time (a GPU's)
            for at, view in _pieces([(entry.offset, tensor.cpu().contiguous())]):
                start = at
                while len(view):
                    written = os.pwrite(fd, view, at)
                    at, view = at + written, view[written:]
                _start_writeback(fd, start, at - start)
    finally:
        os.close(fd)
    return skeleton


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Have the kernel start writing `fd`'s bytes [offset, offset + nbytes) to the disk now,
    without waiting (Linux's sync_file_range; elsewhere nothing: the fsync writes them)."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def read_tensors(path: Path, skeleton: Any, *, mmap: bool = False) -> Any:
    """`skeleton`'s state with its tensors read from `path` (`OSError` if the file is missing or
    shorter than its tensors, `ValueError` if a dtype is unknown). Each tensor has storage of its
    own, as `torch.load` gives it; with `mmap`, each is a view of the file mapped copy-on-write
    (read as it is used: for weights to be copied elsewhere, as an export does)."""
    size = path.stat().st_size
    entries: dict[StoredTensor, torch.dtype] = {}

    def collect(entry: StoredTensor) -> StoredTensor:
        dtype = getattr(torch, entry.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {entry.dtype!r}")
        end = entry.offset + _numel(entry.shape) * dtype.itemsize
        if end > size:
            raise OSError(f"{path.name} holds {size} bytes, a tensor ends at {end}")
        entries[entry] = dtype
        return entry

    _each_leaf(skeleton, StoredTensor, collect)
    loaded: dict[StoredTensor, torch.Tensor] = {}
    if mmap:
        mapped = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
        for entry, dtype in entries.items():
            nbytes = _numel(entry.shape) * dtype.itemsize
            window = mapped[entry.offset : entry.offset + nbytes]
            loaded[entry] = (
                window.view(dtype).view(entry.shape) if nbytes else torch.empty(entry.shape, dtype=dtype)
            )
    else:
        loaded = {entry: torch.empty(entry.shape, dtype=dtype) for entry, dtype in entries.items()}
        pieces = _pieces((entry.offset, tensor) for entry, tensor in loaded.items())
        fd = os.open(path, os.O_RDONLY)
        try:

            def read(piece: tuple[int, memoryview]) -> None:
                at, view = piece
                while len(view):
                    got = os.preadv(fd, [view], at)
                    if got == 0:
                        raise OSError(f"{path.name}: shorter than its size while being read")
                    at, view = at + got, view[got:]

            _each(read, pieces)
        finally:
            os.close(fd)
    return _each_leaf(skeleton, StoredTensor, loaded.__getitem__)


def _each(work: Callable[[Any], None], items: Any) -> None:
    items = list(items)
    if len(items) <= 1:
        for item in items:
            work(item)
        return
    with ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="tensor-file") as pool:
        for _ in pool.map(work, items):
            pass


def _pieces(placed: Iterable[tuple[int, torch.Tensor]]) -> list[tuple[int, memoryview]]:
    """Each tensor's bytes (at its offset in the file) cut into pieces of at most `CHUNK`, each
    with its own offset in the file."""
    return [
        (offset + start, view[start : start + CHUNK])
        for offset, tensor in placed
        if tensor.numel()
        for view in [_bytes(tensor)]
        for start in range(0, len(view), CHUNK)
    ]


def _bytes(tensor: torch.Tensor) -> memoryview:
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


def _each_leaf(value: Any, kind: type, leaf: Callable[[Any], Any]) -> Any:
    """`value` rebuilt (`host_copy.rebuild`) with `leaf` applied to each `kind` in it."""

    def each(item: Any) -> Any:
        return leaf(item) if isinstance(item, kind) else rebuild(item, each)

    return each(value)
