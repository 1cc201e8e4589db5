"""GRPO from a Hugging Face directory, and the trained model back out as one."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.errors import RecipeError
from pipeline.metrics import read
from stages.checkpoint import committed
from stages.generate import generate
from stages.model_files import export, open_model

PROMPT = "What is 3 + 4?"


def _checkpoint(run_dir: Path) -> Path:
    (checkpoint,) = committed(run_dir / "checkpoints")
    return checkpoint


def test_grpo_steps_from_a_hf_checkpoint(tiny_qwen2_run) -> None:
    _, run_dir = tiny_qwen2_run
    steps = [r for r in read(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for record in steps:
        assert math.isfinite(record["train/loss"])
        assert "reward/has_answer" in record  # the math reward's side figure is logged
        # On-policy, engine and trainer score the same tokens with the same weights.
        assert abs(record["train/token_mult_prob_error"] - 1.0) < 1e-3


def test_export_loads_in_transformers_and_generates_our_tokens(tiny_qwen2_run, tmp_path: Path) -> None:
    _, run_dir = tiny_qwen2_run
    checkpoint = _checkpoint(run_dir)
    out = export(checkpoint, tmp_path / "exported")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    trained = torch.load(checkpoint / "trainer.pt", weights_only=False)["model"]
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, trained[name]), name

    ours = generate(open_model(checkpoint), PROMPT, max_new_tokens=12, chat=True)
    ids = torch.tensor([ours.prompt_tokens])
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    new = theirs[0, ids.shape[1] :].tolist()
    assert ours.tokens and ours.tokens == new[: len(ours.tokens)]
    assert ours.finish_reason == "stop" or len(ours.tokens) == len(new) == 12


def test_export_refuses_a_directory_with_a_model(tiny_qwen2_run, tmp_path: Path) -> None:
    _, run_dir = tiny_qwen2_run
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(RecipeError) as raised:
        export(_checkpoint(run_dir), tmp_path)
    assert str(raised.value) == f"{tmp_path}: already holds config.json; export into a new directory"


def test_generate_from_a_directory_that_is_no_model(tmp_path: Path) -> None:
    with pytest.raises(RecipeError) as raised:
        open_model(tmp_path)
    assert str(raised.value) == (
        f"{tmp_path}: neither a checkpoint (trainer.pt and recipe.yaml) "
        "nor a Hugging Face model directory (config.json)"
    )


def test_run_with_missing_model_directory_is_a_recipe_error(tiny_qwen2_run, tmp_path: Path) -> None:
    import anyio

    import pipeline

    recipe, _ = tiny_qwen2_run
    missing = tmp_path / "nowhere"
    with pytest.raises(RecipeError) as raised:
        anyio.run(
            pipeline.run,
            pipeline.load_recipe(
                Path(__file__).parents[1] / "data" / "tiny-hf.yaml",
                [
                    f"run.dir={tmp_path / 'run'}",
                    f"model.path={missing}",
                    f"prompts.source.path={recipe.prompts.source.path}",
                ],
            ),
        )
    assert str(raised.value) == (
        f"model.path: {missing / 'tokenizer.json'} not found: the model's tokenizer is needed to "
        "tokenize prompts (copy tokenizer.json and tokenizer_config.json next to config.json)"
    )
