"""reasoning-gym as a prompt source with its own answer checker; the CPU recipe runs."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

import pipeline
from pipeline.contracts.errors import RecipeError
from pipeline.metrics import read
from stages.prompts import PromptsSection, ReasoningGymSource, build_prompts

reasoning_gym = pytest.importorskip("reasoning_gym")

RECIPE = Path(__file__).parents[2] / "recipes" / "reasoning-gym-cpu.yaml"
SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def test_prompts_and_checker_come_from_the_dataset() -> None:
    source = ReasoningGymSource(name="basic_arithmetic", size=8, num_heldout=2, config=SMALL)
    prompts = build_prompts(PromptsSection(source=source), seed=3)
    entries = list(reasoning_gym.create_dataset("basic_arithmetic", size=8, seed=3, **SMALL))
    assert [p.text for p in prompts.heldout] == [e["question"] for e in entries[6:]]
    assert prompts.reward is not None
    trained = [next(prompts.train) for _ in range(12)]  # two epochs of six
    assert sorted(p.text for p in trained[:6]) == sorted(e["question"] for e in entries[:6])
    for prompt in trained + prompts.heldout:
        assert prompts.tokenizer.decode(prompt.tokens) == prompt.text
        assert prompts.reward(prompt, f" {prompt.answer}\n") == 1.0
        assert prompts.reward(prompt, "nonsense") < 1.0


def test_unknown_dataset_is_named() -> None:
    with pytest.raises(RecipeError) as raised:
        build_prompts(PromptsSection(source=ReasoningGymSource(name="no_such_task")), seed=0)
    assert str(raised.value) == (
        "prompts.source: reasoning_gym dataset 'no_such_task': Dataset 'no_such_task' not registered"
    )


def test_cpu_recipe_runs_two_steps(tmp_path: Path) -> None:
    recipe = pipeline.load_recipe(
        RECIPE, [f"run.dir={tmp_path / 'run'}", "run.steps=2", "run.progress=false", "eval.every_steps=0"]
    )
    summary = anyio.run(pipeline.run, recipe)
    assert summary.steps_done == 2
    steps = [r for r in read(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
