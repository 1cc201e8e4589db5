"""A checkpoint's commit marker (`COMMITTED`): the step and every file, each with its checksum.

The marker is written last into a checkpoint's temporary directory, after every file in it is
written and fsynced; the directory is then renamed into place. It reads

    12                                   the step
    trainer.pt<TAB>1048576<TAB>9a3c00e1  each file: relative path, size in bytes, CRC-32 (hex)
    ...

`verify(directory)` checks every file the marker lists against its size and checksum, so bytes
that changed on disk after the commit (garbled but finite: a torch state or a megatron shard
that still loads) make the checkpoint damaged (`DamagedState`, naming the file) instead of
being trained on. Markers written before checksums list bare names: their files are checked for
presence only.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from pipeline.contracts.errors import DamagedState
from pipeline.contracts.text import NotText, read_text

MARKER = "COMMITTED"
_CHUNK = 64 * 2**20  # a file's piece read and summed by one thread at a time
_THREADS = min(16, os.cpu_count() or 1)


class Listed(msgspec.Struct, frozen=True):
    """A file a marker lists; `size` and `crc32` are None in markers that predate checksums."""

    name: str
    size: int | None = None
    crc32: int | None = None


def checksum(path: Path) -> int:
    """The CRC-32 of `path`'s bytes, as `zlib.crc32` of the whole file. A large file is read and
    summed in pieces on several threads (zlib and the reads release the interpreter lock), the
    pieces' checksums then combined: one thread alone takes seconds for each few GB, and a
    checkpoint's optimizer state can be tens of GB."""
    size = path.stat().st_size
    pieces = [(start, min(_CHUNK, size - start)) for start in range(0, size, _CHUNK)]
    if len(pieces) <= 1:
        with path.open("rb") as handle:
            return zlib.crc32(handle.read())
    fd = os.open(path, os.O_RDONLY)
    buffers = threading.local()  # one buffer a thread, reused: a fresh one is paged in each time
    try:

        def piece(where: tuple[int, int]) -> int:
            start, length = where
            if not hasattr(buffers, "view"):
                buffers.view = memoryview(bytearray(_CHUNK))
            view = buffers.view[:length]
            done = 0
            while done < length:  # a read may return fewer bytes than asked (a network file system)
                got = os.preadv(fd, [view[done:]], start + done)
                if not got:
                    raise OSError(f"{path}: shorter than its size while being read")
                done += got
            return zlib.crc32(view)

        with ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="checksum") as pool:
            sums = list(pool.map(piece, pieces))
    finally:
        os.close(fd)
    value = sums[0]
    for crc, (_, length) in zip(sums[1:], pieces[1:], strict=True):
        value = crc32_combine(value, crc, length)
    return value


# CRC-32 (zlib's polynomial, reflected) of a concatenation from its parts' CRCs, as zlib's
# crc32_combine computes it (which Python's zlib does not expose): crc(A + B) is crc(A) times
# x^(8 len(B)) modulo the polynomial, plus crc(B), in GF(2).
_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """a times b modulo the CRC polynomial (both reflected)."""
    m, product = 1 << 31, 0
    while True:
        if a & m:
            product ^= b
            if not a & (m - 1):
                return product
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    """x^(2^k) modulo the polynomial, k = 0..31."""
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


def crc32_combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """The CRC-32 of A followed by B, from crc32(A), crc32(B) and B's length in bytes."""
    p, k, n = 1 << 31, 3, length_b  # x^0; x^(8n) = x^(n 2^3)
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc_a) ^ crc_b


def marker_text(step: int, files: Sequence[Listed]) -> str:
    lines = [str(step)]
    lines += [f"{f.name}\t{f.size}\t{f.crc32:08x}" for f in files]
    return "".join(f"{line}\n" for line in lines)


def read_marker(directory: Path) -> tuple[int, list[Listed]]:
    """The step and the files `directory`'s marker lists; `DamagedState` if it does not parse."""
    try:
        text = read_text(directory / MARKER)
    except NotText as error:
        raise DamagedState(str(error)) from None
    lines = text.splitlines()
    try:
        step = int(lines[0])
        files = []
        for line in lines[1:]:
            name, *rest = line.split("\t")
            files.append(Listed(name, int(rest[0]), int(rest[1], 16)) if rest else Listed(name))
    except (IndexError, ValueError):
        raise DamagedState(f"{MARKER} does not parse") from None
    return step, files


def verify(directory: Path, files: Sequence[Listed]) -> None:
    """`DamagedState` naming the first listed file that is missing or whose bytes differ from
    those committed (size, then checksum)."""
    for listed in files:
        path = directory / listed.name
        if not path.is_file():
            raise DamagedState(f"{listed.name} is missing")
        if listed.size is None:
            continue
        size = path.stat().st_size
        if size != listed.size:
            raise DamagedState(f"{listed.name} has {size} bytes, {listed.size} were committed")
        if checksum(path) != listed.crc32:
            raise DamagedState(f"{listed.name} does not match its committed checksum (its bytes changed)")
