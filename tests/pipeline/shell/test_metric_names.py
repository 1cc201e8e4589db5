"""The names gates may use are the names runs log: a real CPU run and a fake colocated run."""

from __future__ import annotations

from pathlib import Path

import anyio

import pipeline
from pipeline.metrics import per_evaluation, read
from pipeline.recipe import convert
from pipeline.shell.metric_names import MetricNames
from pipeline.shell.recipe import Recipe
from pipeline.shell.run import run_program
from pipeline.testing import FakeEngine, FakeTime, FakeTrainer

# Names only some configurations write, which neither run below reaches.
NOT_REACHED = {
    "train/offloaded_gb",  # train.offload_optimizer (CUDA)
    "timing/optimizer_reload_s",
    "timing/optimizer_offload_s",
    "metrics/recovered",  # a resume after a kill between a save and its step's line
}


def logged(run_dir: Path) -> tuple[set[str], set[str]]:
    steps = {key for record in read(run_dir / "metrics.jsonl") for key in record}
    evals = {key for record in read(run_dir / "eval.jsonl") for key in record}
    return steps, evals


def real_run(tmp_path: Path) -> tuple[Recipe, Path]:
    """The real torch backend, separate engine (refit), L = 1, KL to a reference, saves, evals."""
    recipe = pipeline.load_recipe(
        "recipes/quickstart.yaml",
        [
            f"run.dir={tmp_path / 'real'}",
            "run.steps=2",
            "run.progress=false",
            "run.plot=false",
            "colocated=false",
            "prompts.prompts_per_step=4",
            "rollout.samples_per_prompt=4",
            "eval.every_steps=1",
            "eval.num_prompts=4",
            "train.kl_coef=0.01",
            "checkpoint.every_steps=1",
            "gates.checks=[]",
        ],
    )
    anyio.run(pipeline.run, recipe)
    return recipe, tmp_path / "real"


def fake_run(tmp_path: Path) -> tuple[Recipe, Path]:
    """Colocated (stand-down and wake) on fakes, with poisoned samples and a skipped update (its
    NaN loss dropped from the line: `metrics/nonfinite_dropped`)."""
    recipe = convert(
        {
            "run": {"dir": str(tmp_path / "fake"), "steps": 2, "progress": False},
            "prompts": {"prompts_per_step": 2, "source": {"kind": "synthetic", "num_heldout": 4}},
            "rollout": {"samples_per_prompt": 2},
            "reward": {"reward_s": 1.0e9},
            "eval": {"every_steps": 0},
        },
        Recipe,
        source="test",
    )
    fake = FakeTime()

    async def drive() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(fake.autojump)
            engine = FakeEngine(time=fake, latency=1.0, nonfinite_calls=[0])
            trainer = FakeTrainer(time=fake, skipped_steps=[1])
            await run_program(recipe, engine=engine, trainer=trainer, time_source=fake)
            tg.cancel_scope.cancel()

    anyio.run(drive)
    return recipe, tmp_path / "fake"


def multi_turn_run(tmp_path: Path) -> tuple[Recipe, Path]:
    """Multi-turn (rollout.environment) on fakes: the env/* figures and the game's info keys."""
    recipe = convert(
        {
            "run": {"dir": str(tmp_path / "multi"), "steps": 1, "progress": False},
            "prompts": {
                "prompts_per_step": 2,
                "source": {"kind": "synthetic", "task": "guess", "num_heldout": 4},
            },
            "rollout": {
                "samples_per_prompt": 2,
                "max_new_tokens": 1,
                "environment": "pipeline.environments.guess:GuessNumber",
            },
            "eval": {"every_steps": 0},
        },
        Recipe,
        source="test",
    )
    fake = FakeTime()

    async def drive() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(fake.autojump)
            engine = FakeEngine(time=fake, latency=1.0, response_len=1)
            await run_program(recipe, engine=engine, trainer=FakeTrainer(time=fake), time_source=fake)
            tg.cancel_scope.cancel()

    anyio.run(drive)
    return recipe, tmp_path / "multi"


def test_every_name_a_run_logs_is_known_and_every_known_name_is_logged(tmp_path: Path) -> None:
    all_steps: set[str] = set()
    all_evals: set[str] = set()
    # The last one's names are checked against what all of them logged.
    for recipe, run_dir in (real_run(tmp_path), multi_turn_run(tmp_path), fake_run(tmp_path)):
        names = MetricNames.for_recipe(recipe)
        steps, evals = logged(run_dir)
        assert steps - names.steps == set()
        assert evals - names.evals == set()
        all_steps |= steps
        all_evals |= evals
    # The other way: no name is known that no run writes (a typo here would pass validation).
    assert names.steps - all_steps == NOT_REACHED
    assert names.evals == all_evals


def test_a_module_function_reward_makes_its_info_keys_known() -> None:
    recipe = convert({"reward": {"function": "mypkg.rewards:score"}}, Recipe, source="test")
    names = MetricNames.for_recipe(recipe)
    assert names.known("reward/format_ok") and names.known("eval/format_ok")
    assert not names.known("reward/format/ok") and not names.known("train/format_ok")
    builtin = MetricNames.for_recipe(convert({}, Recipe, source="test"))
    assert builtin.known("reward/exact_match") and not builtin.known("reward/format_ok")


def test_the_metrics_of_evaluations_are_those_eval_jsonl_holds() -> None:
    names = MetricNames.for_recipe(convert({}, Recipe, source="test"))
    assert {n for n in names.all() if per_evaluation(n)} == names.evals - {"step", "policy_version"}
