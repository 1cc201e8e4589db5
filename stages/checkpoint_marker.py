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

import zlib
from collections.abc import Sequence
from pathlib import Path

import msgspec

from pipeline.contracts.errors import DamagedState
from pipeline.contracts.text import NotText, read_text

MARKER = "COMMITTED"
_CHUNK = 16 * 2**20  # zlib releases the interpreter lock over each chunk of this size


class Listed(msgspec.Struct, frozen=True):
    """A file a marker lists; `size` and `crc32` are None in markers that predate checksums."""

    name: str
    size: int | None = None
    crc32: int | None = None


def checksum(path: Path) -> int:
    value = 0
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return value


def describe_files(directory: Path, names: Sequence[str]) -> list[Listed]:
    """Each of `names` (relative to `directory`) with its size and checksum as on disk now."""
    return [Listed(name, (directory / name).stat().st_size, checksum(directory / name)) for name in names]


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
