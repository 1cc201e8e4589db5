"""GRPO from a Hugging Face directory of each family, and the trained model back out as one."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import anyio
import pytest
import torch
import yaml
from transformers import (
    AutoModelForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import pipeline
from backends.torch.state_file import load_state
from pipeline.contracts.errors import RecipeError
from pipeline.metrics import read
from pipeline.shell.generate import generate
from pipeline.shell.model_files import export, open_model
from stages.checkpoint import committed

PROMPT = "What is 3 + 4?"
RECIPE = Path(__file__).parents[1] / "data" / "tiny-hf.yaml"
# Beside `tiny_qwen2_dir`'s Qwen2: the other families, in its shape, with its tokenizer.
FAMILIES = {
    # head_dim other than hidden_size / heads (16), as in Qwen3's own checkpoints.
    "qwen3": lambda shape: Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=32, tie_word_embeddings=True)),
    "mistral": lambda shape: MistralForCausalLM(MistralConfig(**shape, sliding_window=None)),
}
_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
_SHAPE_KEYS += ("num_attention_heads", "num_key_value_heads", "max_position_embeddings")


@pytest.fixture(scope="module", params=["qwen2", *FAMILIES])
def hf_run(request, tiny_qwen2_run, tiny_qwen2_dir, tmp_path_factory) -> Path:
    """The run directory of `tiny_qwen2_run`'s recipe (3 steps), from a directory of each family."""
    if request.param == "qwen2":
        return tiny_qwen2_run[1]
    root = tmp_path_factory.mktemp(f"tiny-{request.param}")
    qwen2 = json.loads((tiny_qwen2_dir / "config.json").read_text())
    torch.manual_seed(0)
    FAMILIES[request.param]({k: qwen2[k] for k in _SHAPE_KEYS}).save_pretrained(root / "model")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(tiny_qwen2_dir / name, root / "model" / name)
    data = tiny_qwen2_run[0].prompts.source.path
    overrides = [f"run.dir={root / 'run'}", f"model.path={root / 'model'}", f"prompts.source.path={data}"]
    anyio.run(pipeline.run, pipeline.load_recipe(RECIPE, overrides))
    return root / "run"


def _checkpoint(run_dir: Path) -> Path:
    (checkpoint,) = committed(run_dir / "checkpoints")
    return checkpoint


def test_grpo_steps_from_a_hf_checkpoint(hf_run: Path) -> None:
    steps = [r for r in read(hf_run / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for record in steps:
        assert math.isfinite(record["train/loss"])
        assert "reward/has_answer" in record  # the math reward's side figure is logged
        # On-policy, engine and trainer score the same tokens with the same weights.
        assert abs(record["train/token_mult_prob_error"] - 1.0) < 1e-3


def test_export_loads_in_transformers_and_generates_our_tokens(hf_run: Path, tmp_path: Path) -> None:
    checkpoint = _checkpoint(hf_run)
    out = export(checkpoint, tmp_path / "exported")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    trained = load_state(checkpoint / "trainer.pt")["model"]
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == open_model(checkpoint).config.architecture  # the family it started as
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, trained[name]), name

    ours = generate(open_model(checkpoint), PROMPT, max_new_tokens=12, chat=True)
    ids = torch.tensor([ours.prompt_tokens])
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    new = theirs[0, ids.shape[1] :].tolist()
    assert ours.tokens and ours.tokens == new[: len(ours.tokens)]
    assert ours.finish_reason == "stop" or len(ours.tokens) == len(new) == 12


def test_export_writes_the_runs_length_over_the_source_models(tiny_qwen2_run, tmp_path: Path) -> None:
    """The source's generation_config.json is kept (its stop ids, its sampling defaults), with the
    run's `rollout.max_new_tokens` in place of the source model's."""
    recipe, run_dir = tiny_qwen2_run
    source = tmp_path / "model"
    shutil.copytree(recipe.model.path, source)
    eos = json.loads((source / "generation_config.json").read_text())["eos_token_id"]
    (source / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos, "max_new_tokens": 2048, "temperature": 0.7})
    )
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(_checkpoint(run_dir), checkpoint)
    saved = yaml.safe_load((checkpoint / "recipe.yaml").read_text())
    saved["model"]["path"] = str(source)
    (checkpoint / "recipe.yaml").write_text(yaml.safe_dump(saved))
    out = export(checkpoint, tmp_path / "exported")
    assert json.loads((out / "generation_config.json").read_text()) == {
        "eos_token_id": eos,
        "max_new_tokens": recipe.rollout.max_new_tokens,
        "temperature": 0.7,
        "pad_token_id": open_model(checkpoint).tokenizer.pad_id,
    }


def test_export_refuses_a_directory_with_a_model(tiny_qwen2_run, tmp_path: Path) -> None:
    _, run_dir = tiny_qwen2_run
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(RecipeError) as raised:
        export(_checkpoint(run_dir), tmp_path)
    assert str(raised.value) == f"{tmp_path}: not an empty directory; export into a new or empty one"


def test_generate_from_a_directory_that_is_no_model(tmp_path: Path) -> None:
    with pytest.raises(RecipeError) as raised:
        open_model(tmp_path)
    assert str(raised.value) == (
        f"{tmp_path}: neither a checkpoint (trainer.pt and recipe.yaml) "
        "nor a Hugging Face model directory (config.json)"
    )


def test_run_with_missing_model_directory_is_a_recipe_error(tiny_qwen2_run, tmp_path: Path) -> None:
    recipe, _ = tiny_qwen2_run
    missing = tmp_path / "nowhere"
    with pytest.raises(RecipeError) as raised:
        anyio.run(
            pipeline.run,
            pipeline.load_recipe(
                RECIPE,
                [
                    f"run.dir={tmp_path / 'run'}",
                    f"model.path={missing}",
                    f"prompts.source.path={recipe.prompts.source.path}",
                ],
            ),
        )
    assert str(raised.value) == (  # the directory, not a file in it
        f"model.path: {missing}: no such directory; fetch the model into it first, e.g. "
        f"huggingface-cli download ORG/NAME --local-dir {missing}"
    )
