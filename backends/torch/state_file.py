"""The torch backend's checkpoint files: a nested state (tensors, numbers, lists, dicts) per file.

`TorchTrainer` writes `trainer.pt` (model, master weights, optimizer, scheduler, RNG, counters),
`TorchEngine` writes `engine.pt` (its sampling RNG). A state's tensors go in a file of their own
beside it, `trainer.tensors` for `trainer.pt`, written raw in file order, read by many threads
(`backends.torch.tensor_file`); the `.pt` file is a small `torch.save` of the rest, each tensor
in it a reference into the tensor file. Files written whole by `torch.save` (before the tensor
files) load as they always did. A state holding NaN or infinity is never written
(`NonFiniteState`); one whose files are missing, do not load or are not finite is damaged
(`DamagedState`). The pipeline's own files are named in `stages.checkpoint`.
"""

from __future__ import annotations

import math
import shutil
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from backends.torch.tensor_file import read_tensors, write_tensors
from pipeline.contracts.errors import DamagedState, NonFiniteState

TRAINER_FILE = "trainer.pt"
ENGINE_FILE = "engine.pt"


_TENSOR_FILE = "tensor_file"  # the key of a skeleton's reference to its tensor file
_ZIP_CRC = threading.Lock()  # torch.save's CRC setting is process-wide: one save sets it at a time


def save_state(path: Path, state: Any, *, checked: bool = False) -> None:
    """Write `state` to `path` and its tensors to `tensor_path(path)` (`checked`: the caller
    verified it finite, see `refuse_nonfinite`). A short write (a full disk) is an `OSError`
    naming the file and the free space.

    torch.save's zip records go without their CRC-32: computing it (one more pass over the
    bytes, on the writing thread) is not needed, since a checkpoint's commit marker lists a
    checksum of each whole file (`stages.checkpoint_marker`) and torch.load never reads it."""
    if not checked:
        refuse_nonfinite(path, state)
    tensors = tensor_path(path)
    try:
        skeleton = write_tensors(tensors, state)
    except OSError as error:
        raise write_failed(tensors, error) from None
    try:
        with _ZIP_CRC:
            crc = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
            try:
                torch.save({_TENSOR_FILE: tensors.name, "state": skeleton}, path)
            finally:
                torch.serialization.set_crc32_options(crc)
    except RuntimeError as error:
        # torch's zip writer reports a short write (a full disk) as a RuntimeError.
        if "inline_container" not in str(error) and "PytorchStreamWriter" not in str(error):
            raise
        raise write_failed(path, error) from None


def tensor_path(path: Path) -> Path:
    """The file of the tensors of the state file `path`: `trainer.tensors` for `trainer.pt`."""
    return path.with_suffix(".tensors")


def write_failed(path: Path, error: object) -> OSError:
    """A write of `path` that failed (a full disk), as the `OSError` a checkpoint save reports in
    one line: the file, the free space on its disk, the cause."""
    free = shutil.disk_usage(path.parent).free
    return OSError(f"writing {path.name} failed ({free / 2**30:.1f} GiB free on its disk): {error}")


def refuse_nonfinite(path: Path, state: Any) -> None:
    """`NonFiniteState` naming the first NaN or infinity of `state`, were it written to `path`."""
    where = nonfinite(state)
    if where is not None:
        raise NonFiniteState(f"{path.name} would hold non-finite values at {where}")


class StateSnapshot:
    """A state copied apart from the live one (host memory), written to `path` later by
    `write()` as `save_state` writes it (`pipeline.protocols.Snapshot`); `checked`: verified
    finite when it was taken."""

    def __init__(self, path: Path, state: Any, *, checked: bool = False) -> None:
        self.path = path
        self.state = state
        self.checked = checked

    def write(self) -> None:
        save_state(self.path, self.state, checked=self.checked)


def load_state(path: Path, *, mmap: bool = False) -> Any:
    """The state in `path` (and its tensor file), verified finite (`mmap`: on the CPU, read as
    it is used, unverified)."""
    if not path.is_file():
        raise DamagedState(f"{path.name} is missing")
    try:
        if mmap:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        else:
            state = torch.load(path, weights_only=False)
    except Exception as error:  # torch reports a torn or garbled file many ways
        raise DamagedState(f"{path.name} does not load: {type(error).__name__}: {error}") from None
    if isinstance(state, dict) and _TENSOR_FILE in state:
        tensors = path.parent / str(state[_TENSOR_FILE])
        if not tensors.is_file():
            raise DamagedState(f"{tensors.name} is missing")
        try:
            state = read_tensors(tensors, state["state"], mmap=mmap)
        except (OSError, ValueError, KeyError) as error:
            raise DamagedState(f"{tensors.name} does not load: {error}") from None
    where = None if mmap else nonfinite(state)
    if where is not None:
        raise DamagedState(f"{path.name} holds non-finite values at {where}")
    return state


def nonfinite_on_device(value: Any) -> str | None:
    """`nonfinite(value)` for a state on a GPU, in one synchronization: the sum of each floating
    tensor, on its device, then `nonfinite`'s own walk only when a sum is not finite (a NaN, an
    infinity, or a finite tensor whose sum overflows)."""
    sums: dict[torch.device, list[torch.Tensor]] = {}

    def collect(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            if item.is_floating_point() and item.numel():
                sums.setdefault(item.device, []).append(item.sum(dtype=torch.float32))
        elif isinstance(item, dict):
            for v in item.values():
                collect(v)
        elif isinstance(item, list | tuple):
            for v in item:
                collect(v)
        elif isinstance(item, float) and not math.isfinite(item):
            sums.setdefault(torch.device("cpu"), []).append(torch.tensor(item))

    collect(value)
    finite = all(bool(torch.isfinite(torch.stack(each)).all()) for each in sums.values())
    return None if finite else nonfinite(value)


def nonfinite(value: Any, where: str = "") -> str | None:
    """The path to the first NaN or infinity in a nested state (tensors, floats), or None."""
    if isinstance(value, torch.Tensor):
        # A NaN or infinity anywhere makes the sum non-finite; the sum is one pass without a
        # mask (12x faster than isfinite().all() on CPU), and a finite tensor whose sum
        # overflows is caught by the full check.
        if not value.is_floating_point() or bool(torch.isfinite(value.sum())):
            return None
        return None if bool(torch.isfinite(value).all()) else where or "the tensor"
    if isinstance(value, float):
        return None if math.isfinite(value) else where
    items: Iterable[tuple[Any, Any]]
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = nonfinite(item, f"{where}.{key}" if where else str(key))
        if found is not None:
            return found
    return None
