"""Every recipe that fits one GPU, on it: the CPU recipes with `model.device=cuda`, in float32
and bfloat16, colocated and separate, at L = 0, 1 and 2, with evaluation on, stopped after a
checkpoint and resumed once. Each must finish its steps, log only finite figures, never exceed
the lag bound and poison nothing. Its runs are independent: `pytest -n 8` spreads them.

    python -m pytest -m gpu tests/gpu/test_recipe_matrix.py -n 8
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import anyio
import pytest

import pipeline
from pipeline.metrics import read
from pipeline.runner import StopRequest

pytestmark = pytest.mark.gpu

RECIPES = ["recipes/quickstart.yaml", "recipes/reverse-digits.yaml"]
STEPS = 8  # stopped after step 2: at L = 2 the stop's drain trains up to step 5


def _recipe(path: str, run_dir: Path, dtype: str, colocated: bool, lookahead: int) -> Any:
    return pipeline.load_recipe(
        path,
        [
            f"run.dir={run_dir}",
            f"run.steps={STEPS}",
            "run.progress=false",
            "run.plot=false",
            "model.device=cuda",
            f"model.dtype={dtype}",
            f"colocated={str(colocated).lower()}",
            f"async_rl.max_lookahead_versions={lookahead}",
            "eval.every_steps=2",
            "eval.num_prompts=64",
            "checkpoint.every_steps=2",
        ],
    )


def _finite(record: dict[str, Any]) -> bool:
    return all(math.isfinite(v) for v in record.values() if isinstance(v, float))


@pytest.mark.parametrize("lookahead", [0, 1, 2], ids=lambda n: f"L{n}")
@pytest.mark.parametrize("colocated", [True, False], ids=["colocated", "separate"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("path", RECIPES, ids=lambda p: Path(p).stem)
def test_recipe_runs_on_the_gpu(
    tmp_path: Path, path: str, dtype: str, colocated: bool, lookahead: int
) -> None:
    run_dir = tmp_path / "run"
    recipe = _recipe(path, run_dir, dtype, colocated, lookahead)
    stop = StopRequest()

    def echo(record: dict[str, Any]) -> None:
        if record.get("step") == 2:
            stop.request("test stop")

    first = anyio.run(lambda: pipeline.run(recipe, stop=stop, echo=echo))
    assert first.stopped and 2 <= first.steps_done < STEPS
    second = anyio.run(pipeline.run, recipe)  # resumes from the stop's checkpoint
    assert not second.stopped and second.steps_done == STEPS
    steps = [r for r in read(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for record in steps:
        assert _finite(record) and not record.get("metrics/nonfinite_dropped"), record
        assert record["rollout/max_lag"] <= lookahead, record
        assert record["rollout/poisoned_samples"] == 0, record
        assert record["train/skipped_steps"] == 0, record
    evals = read(run_dir / "eval.jsonl")
    assert {r["step"] for r in evals} >= {0, 2, 4, 6, 8}
    assert all(_finite(r) and math.isfinite(r["eval/reward"]) for r in evals)
    if lookahead == 0:  # on-policy: the engine's logprobs are the trainer's, to rounding
        bound = 1.01 if dtype == "float32" else 1.05
        assert steps[0]["train/token_mult_prob_error"] < bound, steps[0]
