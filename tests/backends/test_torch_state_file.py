"""The torch backend's checkpoint files: what `TorchTrainer.save`/`load` write and refuse."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from test_torch_trainer import _groups, _trainer

from backends.torch.state_file import TRAINER_FILE, load_state, save_state
from pipeline.contracts.errors import DamagedState, NonFiniteState


def test_a_saved_trainer_loads_back_and_steps_as_the_original_does(tmp_path: Path) -> None:
    """Catches a save or load that drops part of the state (optimizer moments, schedule, RNG)."""
    original = _trainer(micro_batch_samples=256, updates_per_step=1)
    original._train_step(_groups())
    original.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [TRAINER_FILE, "trainer.tensors"]
    resumed = _trainer(micro_batch_samples=256, updates_per_step=1)
    resumed.load(tmp_path)
    assert resumed.completed_steps == 1
    assert resumed._train_step(_groups()) == original._train_step(_groups())


def test_a_non_finite_state_is_refused_on_save_and_on_load(tmp_path: Path) -> None:
    with pytest.raises(NonFiniteState) as refused:
        save_state(tmp_path / TRAINER_FILE, {"optimizer": {"moment": torch.tensor([1.0, float("nan")])}})
    assert str(refused.value) == "trainer.pt would hold non-finite values at optimizer.moment"
    assert not (tmp_path / TRAINER_FILE).exists()
    torch.save({"scale": float("inf")}, tmp_path / TRAINER_FILE)
    with pytest.raises(DamagedState) as damaged:
        load_state(tmp_path / TRAINER_FILE)
    assert str(damaged.value) == "trainer.pt holds non-finite values at scale"


def test_a_torn_or_missing_file_is_damaged(tmp_path: Path) -> None:
    trainer = _trainer(micro_batch_samples=256, updates_per_step=1)
    with pytest.raises(DamagedState) as missing:
        trainer.load(tmp_path)
    assert str(missing.value) == "trainer.pt is missing"
    trainer.save(tmp_path)
    path = tmp_path / TRAINER_FILE
    path.write_bytes(path.read_bytes()[:10])
    with pytest.raises(DamagedState) as torn:
        trainer.load(tmp_path)
    assert str(torn.value).startswith("trainer.pt does not load: ")
    trainer.save(tmp_path)
    tensors = tmp_path / "trainer.tensors"
    tensors.write_bytes(tensors.read_bytes()[:-100])
    with pytest.raises(
        DamagedState, match=r"^trainer.tensors does not load: trainer.tensors holds \d+ bytes"
    ):
        trainer.load(tmp_path)
    tensors.unlink()
    with pytest.raises(DamagedState, match=r"^trainer.tensors is missing$"):
        trainer.load(tmp_path)


def test_a_state_written_whole_by_torch_save_still_loads(tmp_path: Path) -> None:
    """Checkpoints written before the tensor files resume as they did."""
    state = {"model": {"w": torch.randn(3, 4)}, "completed_steps": 2}
    torch.save(state, tmp_path / TRAINER_FILE)
    loaded = load_state(tmp_path / TRAINER_FILE)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"]) and loaded["completed_steps"] == 2


def test_a_short_write_is_an_os_error_naming_the_file_and_the_free_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch reports a full disk as a RuntimeError of its zip writer: the checkpoint writer
    must see it as the I/O failure it is (an `OSError`, which it turns into a one-line error
    keeping the last good checkpoint), not as a bug."""

    def short_write(*_: object) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 3087591168 vs 30875")

    monkeypatch.setattr(torch, "save", short_write)
    free = r"\([0-9.]+ GiB free on its disk\)"
    with pytest.raises(OSError, match=rf"^writing trainer.pt failed {free}: \[enforce fail at inline_"):
        save_state(tmp_path / TRAINER_FILE, {"step": 1})

    def full_disk(*_: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full_disk)
    with pytest.raises(OSError, match=rf"^writing trainer.tensors failed {free}: .*No space left on device"):
        save_state(tmp_path / TRAINER_FILE, {"w": torch.ones(3)})
    monkeypatch.undo()
    monkeypatch.setattr(torch, "save", lambda *_: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # anything else is a bug, raised as it is
        save_state(tmp_path / TRAINER_FILE, {"step": 1})
