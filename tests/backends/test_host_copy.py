"""Snapshots for asynchronous checkpoints: host copies that stay as taken, in a reused buffer,
and a trainer snapshot written later that equals a save at the snapshot."""

from __future__ import annotations

from pathlib import Path

import anyio
import torch
from test_torch_trainer import _groups, _trainer

from backends.torch.host_copy import HostCopier
from backends.torch.state_file import TRAINER_FILE, load_state


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
