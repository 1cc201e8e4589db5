"""The backend registry: `train.backend` names the module that builds the engine and trainer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backends.registry import build_backend
from backends.torch.config import ModelConfig
from backends.torch.engine import TorchEngine
from backends.torch.section import ModelSection
from backends.torch.trainer import TorchTrainer
from pipeline.contracts.errors import RecipeError
from pipeline.shell.recipe import Recipe


def test_the_default_backend_builds_the_torch_engine_and_trainer_sharing_one_model() -> None:
    """Catches a registry that maps `torch` to the wrong module or drops the recipe's options."""
    engine, trainer = build_backend(Recipe(), vocab_size=16, stop_ids=(1,))
    try:
        assert isinstance(engine, TorchEngine) and isinstance(trainer, TorchTrainer)
        assert engine.source is trainer.model  # colocated: one set of weights
    finally:
        trainer.close()


def test_a_model_directory_the_backend_cannot_load_is_a_model_path_error(tmp_path: Path) -> None:
    """The torch backend's load errors reach the user as bad input naming `model.path`."""
    (tmp_path / "config.json").write_text(json.dumps(ModelConfig(vocab_size=16).to_hf_dict()))
    recipe = Recipe(model=ModelSection(path=str(tmp_path)))
    with pytest.raises(RecipeError) as raised:
        build_backend(recipe, vocab_size=16, stop_ids=(1,))
    assert str(raised.value) == (
        f"model.path: {tmp_path}: missing model.safetensors (and no model.safetensors.index.json)"
    )
