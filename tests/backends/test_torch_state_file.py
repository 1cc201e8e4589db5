"""The torch backend's checkpoint files: what `TorchTrainer.save`/`load` write and refuse."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_torch_trainer import _groups, _trainer

from backends.torch.state_file import TRAINER_FILE, load_state, save_state
from pipeline.errors import DamagedState, NonFiniteState


def test_a_saved_trainer_loads_back_and_steps_as_the_original_does(tmp_path: Path) -> None:
    """Catches a save or load that drops part of the state (optimizer moments, schedule, RNG)."""
    original = _trainer(micro_batch_samples=256, updates_per_step=1)
    original._train_step(_groups())
    original.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [TRAINER_FILE]
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
