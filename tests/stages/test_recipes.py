"""Recipes: every shipped one loads; bad ones fail with one exact, actionable message."""

from __future__ import annotations

from pathlib import Path

import pytest

import pipeline
from pipeline.errors import RecipeError
from stages.recipe import Recipe

RECIPES = sorted((Path(__file__).parents[2] / "recipes").glob("*.yaml"))


def test_there_are_recipes() -> None:
    assert RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_recipe_loads(path: Path) -> None:
    recipe = pipeline.load_recipe(path)
    assert isinstance(recipe, Recipe)


VALID_RUN_FIELDS = "dir, steps, seed, stop_grace_s, progress, log_every_steps, plot"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param(
            "run:\n  stepz: 3\n",
            f"run.stepz: unknown field (did you mean `steps`?); valid fields: {VALID_RUN_FIELDS}",
            id="unknown-key",
        ),
        pytest.param(
            "colour: blue\n",
            "colour: unknown field; valid fields: run, async_rl, colocated, checkpoint, watchdog, wandb, "
            "tensorboard, model, prompts, rollout, reward, train, eval, faults",
            id="unknown-section",
        ),
        pytest.param(
            "run:\n  steps: three\n", "run.steps: Expected `int`, got `str` ('three')", id="wrong-type"
        ),
        pytest.param("run: 3\n", "run: Expected `object`, got `int` (3)", id="section-not-a-mapping"),
        pytest.param(
            "async_rl:\n  max_lookahead_versions: -1\n",
            "async_rl.max_lookahead_versions: Expected `int` >= 0, got -1",
            id="negative-lookahead",
        ),
        pytest.param(
            "checkpoint:\n  keep_last: 1\n",
            "checkpoint.keep_last: Expected `int` >= 2, got 1",
            id="keep-last",
        ),
        pytest.param(
            "rollout:\n  top_p: 1.5\n", "rollout.top_p: Expected `float` <= 1.0, got 1.5", id="top-p"
        ),
        pytest.param(
            "train:\n  lr: 1e-5\n",
            "train.lr: Expected `float`, got `str` ('1e-5'): YAML reads 1e-5 as a string, write 1.0e-5",
            id="lr-read-as-string",
        ),
        pytest.param(
            "train:\n  schedule: linear\n",
            "train.schedule: Invalid enum value 'linear'; expected one of: constant, cosine",
            id="bad-literal",
        ),
        pytest.param(
            "prompts:\n  source:\n    kind: csv\n",
            "prompts.source.kind: Invalid value 'csv'; expected one of: "
            "jsonl, parquet, reasoning_gym, synthetic",
            id="union-unknown-kind",
        ),
        pytest.param(
            "prompts:\n  source:\n    kind: jsonl\n",
            "prompts.source.path: required field is missing",
            id="union-missing-field",
        ),
        pytest.param(
            "prompts:\n  source:\n    kind: synthetic\n    min_digits: 6\n    max_digits: 5\n",
            "prompts.source: min_digits (6) must be <= max_digits (5)",
            id="cross-field",
        ),
        pytest.param(
            "prompts:\n  system_prompt: Be brief.\n",
            "prompts: system_prompt needs chat_template: true",
            id="system-prompt-without-chat-template",
        ),
    ],
)
def test_bad_recipe_message(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError) as raised:
        pipeline.load_recipe(path)
    assert str(raised.value) == f"{path}: {message}"


def test_yaml_syntax_error_names_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("run:\n  steps: 3\n   seed: 1\n")
    with pytest.raises(RecipeError) as raised:
        pipeline.load_recipe(path)
    assert str(raised.value) == f"{path}: invalid YAML: line 3, column 8: mapping values are not allowed here"


def test_recipe_that_is_not_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("- run\n- steps\n")
    with pytest.raises(RecipeError) as raised:
        pipeline.load_recipe(path)
    assert str(raised.value) == f"{path}: a recipe must be a mapping of sections, got list"


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(RecipeError) as raised:
        pipeline.load_recipe(path)
    assert str(raised.value) == f"{path}: recipe file not found"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        pytest.param(
            "run.steps", "override 'run.steps': expected key.path=value, e.g. run.steps=20", id="no-equals"
        ),
        pytest.param("=3", "override '=3': expected key.path=value, e.g. run.steps=20", id="no-key"),
        pytest.param(
            "run..steps=3",
            "override 'run..steps=3': expected key.path=value, e.g. run.steps=20",
            id="empty-part",
        ),
        pytest.param(
            "run.steps.x=3", "override 'run.steps.x=3': steps in {path} is not a section", id="into-a-value"
        ),
        pytest.param(
            "run.stepz=3",
            "{path}: override 'run.stepz=3': run.stepz: unknown field (did you mean `steps`?); "
            f"valid fields: {VALID_RUN_FIELDS}",
            id="unknown-key",
        ),
        pytest.param(
            "nosuch.x=1",
            "{path}: override 'nosuch.x=1': nosuch: unknown field; valid fields: run, async_rl, colocated, "
            "checkpoint, watchdog, wandb, tensorboard, model, prompts, rollout, reward, train, eval, faults",
            id="unknown-section",
        ),
        pytest.param(
            "train.lr=1e-5",
            "{path}: override 'train.lr=1e-5': train.lr: Expected `float`, got `str` ('1e-5'): "
            "YAML reads 1e-5 as a string, write 1.0e-5",
            id="lr-read-as-string",
        ),
        pytest.param(
            "run.steps=0",
            "{path}: override 'run.steps=0': run.steps: Expected `int` >= 1, got 0",
            id="out-of-range",
        ),
    ],
)
def test_bad_override_message(tmp_path: Path, override: str, message: str) -> None:
    path = tmp_path / "good.yaml"
    path.write_text("run:\n  steps: 3\n")
    with pytest.raises(RecipeError) as raised:
        pipeline.load_recipe(path, [override])
    assert str(raised.value) == message.format(path=path)


def test_overrides_are_applied_as_yaml_values(tmp_path: Path) -> None:
    path = tmp_path / "good.yaml"
    path.write_text("run:\n  steps: 3\n")
    recipe = pipeline.load_recipe(
        path, ["run.steps=7", "train.lr=2.0e-5", "async_rl.max_lookahead_versions=0"]
    )
    assert (recipe.run.steps, recipe.train.lr, recipe.async_rl.max_lookahead_versions) == (7, 2.0e-5, 0)


def test_evaluation_without_held_out_prompts_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text("prompts:\n  source:\n    kind: jsonl\n    path: data.jsonl\neval:\n  every_steps: 5\n")
    with pytest.raises(RecipeError) as error:
        pipeline.load_recipe(path)
    assert str(error.value) == (
        f"{path}: eval.every_steps needs held-out prompts: set prompts.source.num_heldout > 0 "
        "or eval.every_steps: 0"
    )
