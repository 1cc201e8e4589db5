"""A trained model as files: open a run checkpoint or a Hugging Face directory; export one.

A run checkpoint (`run.dir/checkpoints/step-NNNNNN/`) holds `trainer.pt` (its `"model"` entry
is the state dict) and `recipe.yaml`, whose `model` section gives the shape (`config`) or the
Hugging Face directory the run started from (`path`, read again for its config.json and its
tokenizer). `export` writes what `transformers` loads: config.json, model.safetensors, and the
tokenizer files of that directory (or, for a character-tokenizer run, its alphabet in
char_tokenizer.json and a generation_config.json with its end-of-sequence id), into a new or
empty directory.

Used by the `export` and `generate` commands; it imports torch, so the CLI imports it lazily.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from backends.torch.config import ModelConfig
from backends.torch.errors import ModelLoadError
from backends.torch.hf import CONFIG_FILE, load_pretrained, read_config, save_pretrained
from backends.torch.model import Decoder
from backends.torch.state_file import TRAINER_FILE, load_state
from pipeline.contracts.errors import DamagedState, RecipeError
from pipeline.contracts.text import NotText, read_text
from pipeline.recipe import convert
from pipeline.shell.recipe import Recipe
from stages.checkpoint import RECIPE_FILE
from stages.hf_tokenizer import GENERATION_CONFIG_FILE, TOKENIZER_FILE, TOKENIZER_FILES, HFTokenizer
from stages.prompts import build_tokenizer
from stages.tokenizer import CHAR_TOKENIZER_FILE, CharTokenizer, Tokenizer


@dataclass
class OpenedModel:
    config: ModelConfig
    model: Decoder
    tokenizer: Tokenizer | None  # None: a Hugging Face directory without tokenizer.json
    hf_dir: Path | None  # the Hugging Face directory whose tokenizer files go with the weights
    max_new_tokens: int | None  # what the model was trained to generate, where known


def is_checkpoint(path: Path) -> bool:
    return (path / TRAINER_FILE).is_file() and (path / RECIPE_FILE).is_file()


def open_model(path: str | Path, *, device: str = "cpu") -> OpenedModel:
    """The model (in eval mode, on `device`) and tokenizer of a checkpoint or a Hugging Face
    directory; `RecipeError` naming the path for anything else or anything missing."""
    path = Path(path)
    try:
        if is_checkpoint(path):
            return _open_checkpoint(path, device)
        if (path / CONFIG_FILE).is_file():
            config, model = load_pretrained(path, device=device)
            return OpenedModel(config, model.eval(), _hf_tokenizer(path), path, _trained_length(path))
    except ModelLoadError as error:
        raise RecipeError(str(error)) from None
    raise RecipeError(
        f"{path}: neither a checkpoint ({TRAINER_FILE} and {RECIPE_FILE}) "
        f"nor a Hugging Face model directory ({CONFIG_FILE})"
    )


def _hf_tokenizer(path: Path) -> Tokenizer | None:
    if (path / TOKENIZER_FILE).is_file():
        return HFTokenizer(path)
    if (path / CHAR_TOKENIZER_FILE).is_file():  # exported from a run on a built-in task
        return CharTokenizer.load(path)
    return None


def _trained_length(path: Path) -> int | None:
    """generation_config.json's `max_new_tokens` (export writes the run's), if any."""
    try:
        value = json.loads((path / GENERATION_CONFIG_FILE).read_bytes()).get("max_new_tokens")
    except (OSError, ValueError, AttributeError):  # ValueError: not JSON, or not UTF-8
        return None
    return value if isinstance(value, int) and value > 0 else None


def _open_checkpoint(path: Path, device: str) -> OpenedModel:
    recipe_path = path / RECIPE_FILE
    try:
        text = read_text(recipe_path)
    except NotText as error:
        raise RecipeError(str(error)) from None
    recipe = convert(yaml.safe_load(text) or {}, Recipe, source=str(recipe_path))
    section = recipe.model
    hf_dir = Path(section.path) if section.path is not None else None
    if hf_dir is not None:
        config_path = hf_dir / CONFIG_FILE
        if not config_path.is_file():
            raise RecipeError(
                f"{recipe_path}: model.path: {config_path} not found (the checkpoint's weights are in "
                "trainer.pt; its shape and tokenizer are read from the directory the run started from)"
            )
        config = read_config(hf_dir)
    else:
        assert section.config is not None
        config = section.config
    try:  # mmap: the optimizer state beside the weights is never read into memory
        state = load_state(path / TRAINER_FILE, mmap=True)
    except DamagedState as error:
        raise RecipeError(f"{path}: {error}") from None
    if "model" not in state:
        raise RecipeError(f"{path / TRAINER_FILE}: no 'model' entry (not a trainer checkpoint)")
    weights = state["model"]
    dtype = next(iter(weights.values())).dtype
    with torch.device(device):
        model = Decoder(config).to(dtype)
    model.load_state_dict(weights)
    tokenizer = build_tokenizer(recipe.prompts, section.path)
    return OpenedModel(config, model.eval(), tokenizer, hf_dir, recipe.rollout.max_new_tokens)


def export(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write `checkpoint` (a run checkpoint or a Hugging Face directory) to `out_dir` as a
    Hugging Face directory; refuses a directory that already holds a model."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RecipeError(f"{out}: not an empty directory; export into a new or empty one")
    opened = open_model(checkpoint)
    if opened.config.learned_position_embeddings:
        raise RecipeError(
            f"{checkpoint}: a model with learned_position_embeddings has no Hugging Face "
            "Llama/Qwen2 equivalent and cannot be exported"
        )
    save_pretrained(opened.config, opened.model, out)
    if opened.hf_dir is not None:
        for name in TOKENIZER_FILES:
            if (opened.hf_dir / name).is_file():
                shutil.copyfile(opened.hf_dir / name, out / name)
    if isinstance(opened.tokenizer, CharTokenizer):
        opened.tokenizer.save(out)
    if not (out / GENERATION_CONFIG_FILE).exists() and opened.tokenizer is not None:
        # transformers then stops generating where our engine does, and `generate` (ours and
        # transformers') generates as many tokens as the run did.
        tokenizer = opened.tokenizer
        stop = list(tokenizer.stop_ids)
        generation: dict[str, object] = {
            "eos_token_id": stop[0] if len(stop) == 1 else stop,
            "pad_token_id": tokenizer.pad_id,
        }
        if opened.max_new_tokens is not None:
            generation["max_new_tokens"] = opened.max_new_tokens
        (out / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n")
    return out
