"""Snapshots for asynchronous checkpoints: host copies that stay as taken, in a reused buffer
reserved ahead, a trainer snapshot written later that equals a save at the snapshot and refuses
a non-finite state when it is taken, and the state file's write."""

from __future__ import annotations

import zipfile
from pathlib import Path

import anyio
import pytest
import torch
from test_torch_trainer import _groups, _trainer

from backends.torch.host_copy import HostCopier
from backends.torch.state_file import TRAINER_FILE, load_state, nonfinite, nonfinite_on_device, save_state
from pipeline.contracts.errors import NonFiniteState


def test_a_copy_stays_as_taken_while_the_state_changes() -> None:
    weight = torch.randn(5, 6)
    taken = weight.clone()
    state = {"w": weight, "tied": [weight], "columns": weight[:, 2:4], "step": 3}
    copy = HostCopier().copy(state)
    weight.add_(1.0)
    assert torch.equal(copy["w"], taken) and torch.equal(copy["columns"], taken[:, 2:4])
    assert copy["tied"][0] is copy["w"]  # the same tensor twice stays one (tied weights)
    assert copy["step"] == 3 and copy["tied"] is not state["tied"]


def test_the_buffer_is_allocated_once_and_a_saved_copy_holds_only_its_own_bytes(tmp_path: Path) -> None:
    host = HostCopier()
    state = {"a": torch.randn(100), "b": torch.randn(7, 3).double()}
    for _ in range(3):
        copy = host.copy(state)
    assert host.allocations == 1
    assert copy["a"].untyped_storage().data_ptr() - host.arena.data_ptr() in range(host.arena.numel())
    assert copy["b"].untyped_storage().nbytes() == 7 * 3 * 8  # torch.save writes this, not the arena
    torch.save(copy, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt")
    assert torch.equal(loaded["a"], state["a"]) and torch.equal(loaded["b"], state["b"])


def test_a_trainer_snapshot_written_after_more_steps_is_the_state_at_the_snapshot(tmp_path: Path) -> None:
    trainer = _trainer(micro_batch_samples=256, updates_per_step=1)
    anyio.run(trainer.train_step, _groups())
    (tmp_path / "saved").mkdir()
    (tmp_path / "snapshot").mkdir()
    trainer.save(tmp_path / "saved")
    snapshot = trainer.snapshot(tmp_path / "snapshot")
    anyio.run(trainer.train_step, _groups())  # the live state moves on
    snapshot.write()
    saved = load_state(tmp_path / "saved" / TRAINER_FILE)
    written = load_state(tmp_path / "snapshot" / TRAINER_FILE)
    assert written["completed_steps"] == saved["completed_steps"] == 1
    for part in ("model", "optimizer"):
        flat_saved, flat_written = _tensors(saved[part]), _tensors(written[part])
        assert flat_saved.keys() == flat_written.keys()
        assert all(torch.equal(flat_saved[k], flat_written[k]) for k in flat_saved)
    assert torch.equal(saved["generator"], written["generator"])
    trainer.close()


def _tensors(value: object, where: str = "") -> dict[str, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return {where: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    return {k: v for key, item in items for k, v in _tensors(item, f"{where}.{key}").items()}


def test_a_reserved_buffer_takes_the_next_copy_without_allocating_in_it() -> None:
    host = HostCopier()
    state = {"a": torch.randn(1000), "b": [torch.randn(30, 3).double()]}
    host.reserve(state)
    host.wait()
    reserved = host.arena
    assert host.allocations == 1 and reserved is not None
    assert reserved.numel() >= 1000 * 4 + 90 * 8 and not reserved.any()  # every page touched
    copy = host.copy(state)
    assert host.allocations == 1 and host.arena is reserved
    assert copy["a"].untyped_storage().data_ptr() - reserved.data_ptr() in range(reserved.numel())
    assert torch.equal(copy["b"][0], state["b"][0])
    host.reserve(state)  # enough already: nothing new
    host.wait()
    assert host.allocations == 1 and host.arena is reserved
    bigger = {**state, "c": torch.randn(10_000)}
    host.reserve(bigger)  # more than the arena holds: a new one, the copies of the old one intact
    copy_again = host.copy(bigger)
    assert host.allocations == 2 and host.arena is not reserved
    assert torch.equal(copy["a"], state["a"]) and torch.equal(copy_again["c"], bigger["c"])


def test_a_trainer_reserves_its_snapshot_buffer_after_its_first_step(tmp_path: Path) -> None:
    """So the first snapshot, in a step that saves, finds its host buffer allocated and (on a
    GPU) pinned instead of doing both inside the step."""
    trainer = _trainer(micro_batch_samples=256, updates_per_step=1)
    anyio.run(trainer.train_step, _groups())
    trainer._host.wait()
    assert trainer._host.allocations == 1
    reserved = trainer._host.arena
    (tmp_path / "snapshot").mkdir()
    trainer.snapshot(tmp_path / "snapshot").write()
    anyio.run(trainer.train_step, _groups())
    trainer._host.wait()
    assert trainer._host.allocations == 1 and trainer._host.arena is reserved
    trainer.close()


def test_a_snapshot_refuses_a_non_finite_state_when_it_is_taken(tmp_path: Path) -> None:
    """The state is checked where it lives, in the step (the write then skips its own check)."""
    trainer = _trainer(micro_batch_samples=256, updates_per_step=1)
    anyio.run(trainer.train_step, _groups())
    with torch.no_grad():
        next(trainer.model.parameters()).view(-1)[0] = float("nan")
    with pytest.raises(NonFiniteState, match=r"^trainer.pt would hold non-finite values at model\."):
        trainer.snapshot(tmp_path)
    assert not (tmp_path / TRAINER_FILE).exists()
    trainer.close()


@pytest.mark.parametrize(
    ("state", "where"),
    [
        ({"w": torch.tensor([1.0, 2.0])}, None),
        ({"w": [torch.tensor([1.0]), torch.tensor([float("nan")])]}, "w.1"),
        ({"w": torch.tensor([1, 2]), "lr": float("inf")}, "lr"),
        ({"w": torch.tensor([3e38, 3e38])}, None),  # a sum that overflows, values all finite
        ({"w": torch.tensor([-float("inf")]).bfloat16()}, "w"),
    ],
)
def test_the_device_check_finds_what_the_full_walk_finds(state: dict[str, object], where: str | None) -> None:
    assert nonfinite_on_device(state) == nonfinite(state) == where


def test_a_state_file_is_written_without_torch_zip_checksums(tmp_path: Path) -> None:
    """The commit marker checksums the whole file; torch.load reads it as well without them."""
    state = {"w": torch.randn(64), "n": 3}
    save_state(tmp_path / "state.pt", state)
    with zipfile.ZipFile(tmp_path / "state.pt") as archive:
        assert {info.CRC for info in archive.infolist()} == {0}
    loaded = load_state(tmp_path / "state.pt")
    assert torch.equal(loaded["w"], state["w"]) and loaded["n"] == 3
    assert torch.serialization.get_crc32_options()  # the process's own setting left as it was
