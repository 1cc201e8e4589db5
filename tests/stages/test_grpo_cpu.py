"""The real GRPO loop on CPU: learning, lag bounds and engine/trainer agreement."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

import pipeline
from pipeline.metrics import read


def _run(tmp_path: Path, *overrides: str, recipe_path: str = "recipes/quickstart.yaml") -> list[dict]:
    recipe = pipeline.load_recipe(
        recipe_path, [f"run.dir={tmp_path / 'run'}", "run.progress=false", "run.plot=false", *overrides]
    )
    anyio.run(pipeline.run, recipe)
    return read(tmp_path / "run" / "metrics.jsonl")


@pytest.mark.parametrize("colocated", [True, False])
@pytest.mark.parametrize("lookahead", [0, 1, 2])
def test_lag_never_exceeds_lookahead(tmp_path: Path, colocated: bool, lookahead: int) -> None:
    records = _run(
        tmp_path,
        "run.steps=6",
        "eval.every_steps=0",
        f"colocated={str(colocated).lower()}",
        f"async_rl.max_lookahead_versions={lookahead}",
    )
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert max(r["rollout/max_lag"] for r in steps) <= lookahead
    if lookahead:  # the CPU engine is fast enough that generation runs ahead
        assert max(r["rollout/max_lag"] for r in steps) == lookahead


def test_on_policy_step_engine_and_trainer_agree(tmp_path: Path) -> None:
    records = _run(tmp_path, "run.steps=3", "eval.every_steps=0", "async_rl.max_lookahead_versions=0")
    updates = pipeline.load_recipe("recipes/quickstart.yaml").train.updates_per_step
    for record in (r for r in records if "train/loss" in r):
        assert record["rollout/max_lag"] == 0
        assert abs(record["train/token_mult_prob_error"] - 1.0) < 1e-3
        assert record["train/gen_kl_error"] < 1e-4
        # Every update applied: what the train stage's skip limit reads.
        assert record["train/applied_updates"] == updates


def test_multi_turn_engine_and_trainer_agree_on_the_models_tokens_only(tmp_path: Path) -> None:
    """Multi-turn on the real backend, on-policy: the trainer's recomputed logprobs of the model's
    tokens equal the engine's over whole episodes (up to four turns, each continuing the context
    with the game's replies in it), and only the model's tokens are trained (one per turn)."""
    records = _run(
        tmp_path,
        "run.steps=2",
        "eval.every_steps=0",
        "async_rl.max_lookahead_versions=0",
        "prompts.prompts_per_step=8",
        recipe_path="recipes/multi-turn-cpu.yaml",
    )
    for record in (r for r in records if "train/loss" in r):
        assert abs(record["train/token_mult_prob_error"] - 1.0) < 1e-3
        assert record["train/gen_kl_error"] < 1e-4
        assert record["env/turns_max"] > 1
        assert record["train/tokens"] == record["env/turns_mean"] * record["rollout/samples"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("colocated", "lookahead", "steps"),
    [(True, 0, 100), (True, 1, 100), (True, 2, 100), (False, 2, 200)],
    ids=["colocated-L0-partial", "colocated-L1-partial", "colocated-L2-partial", "separate-L2"],
)
def test_quickstart_learns(tmp_path: Path, colocated: bool, lookahead: int, steps: int) -> None:
    """Colocated with partial rollouts on (at L >= 1 the next batch's requests freeze at each
    stand-down and finish under the new weights), and separate without."""
    records = _run(
        tmp_path,
        f"run.steps={steps}",
        "eval.every_steps=100",
        "eval.num_prompts=128",
        f"colocated={str(colocated).lower()}",
        f"rollout.partial={str(colocated).lower()}",
        f"async_rl.max_lookahead_versions={lookahead}",
    )
    assert len(records) == steps
    evals = [r["eval/reward"] for r in read(tmp_path / "run" / "eval.jsonl")]
    assert len(evals) == 1 + steps // 100  # before training, then every 100 steps
    assert evals[0] < 0.3
    assert evals[-1] > 0.8
    assert max(r["rollout/max_lag"] for r in records) <= lookahead
    partial = sum(r["rollout/partial_samples"] for r in records)
    assert (partial > 0) == (colocated and lookahead > 0)


@pytest.mark.slow
def test_reverse_digits_recipe_passes_the_bar(tmp_path: Path) -> None:
    """The TRL comparison task: reversal from random weights, past 0.8 held-out by step 100."""
    recipe = pipeline.load_recipe(
        "recipes/reverse-digits.yaml",
        [
            f"run.dir={tmp_path / 'run'}",
            "run.progress=false",
            "run.plot=false",
            "run.steps=100",
            "eval.every_steps=100",
            "eval.num_prompts=128",
        ],
    )
    anyio.run(pipeline.run, recipe)
    evals = read(tmp_path / "run" / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 100]
    assert evals[0]["eval/reward"] < 0.3
    assert evals[-1]["eval/reward"] > 0.8
    assert "eval/exact_match" in evals[-1]


def test_handoff_check_stops_a_run_whose_refit_leaves_a_tensor_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real engine and trainer take fingerprints at each refit and step, and the gate
    compares them: a refit that skips one tensor stops the run, naming it."""
    import torch

    from backends.torch.engine import TorchEngine
    from pipeline.contracts.errors import HandoffMismatch

    def copy_all_but_the_last(self: TorchEngine) -> None:
        with torch.no_grad():
            pairs = list(zip(self.sampler.model.parameters(), self.source.parameters(), strict=True))
            for target, value in pairs[:-1]:
                target.copy_(value)
        self._take_fingerprint()

    monkeypatch.setattr(TorchEngine, "_copy_weights", copy_all_but_the_last)
    last = [name for name, _ in torch.nn.Module.named_parameters(_quickstart_model())][-1]
    args = ["run.steps=2", "eval.every_steps=0", "colocated=false"]
    with pytest.raises(HandoffMismatch, match=f"after the refit to version 1 .*: {last} differs"):
        _run(tmp_path, *args)
    _run(tmp_path, *args, "async_rl.handoff_checks=false", f"run.dir={tmp_path / 'unchecked'}")


def _quickstart_model():
    from backends.torch.build import build_model

    recipe = pipeline.load_recipe("recipes/quickstart.yaml")
    return build_model(recipe.model, vocab_size=16, seed=0)


def test_a_finished_runs_model_is_reclaimed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Start-up freezes what it builds (`pipeline.startup`); the run's end thaws it, so a host
    running pipelines one after another gets each run's model back."""
    import gc
    import weakref

    from backends.torch import build

    models: list[weakref.ref] = []
    real = build.build_model

    def recording(*args, **kwargs):
        model = real(*args, **kwargs)
        models.append(weakref.ref(model))
        return model

    monkeypatch.setattr(build, "build_model", recording)
    _run(tmp_path, "run.steps=1", "eval.every_steps=0")
    gc.collect()
    assert len(models) == 1 and models[0]() is None
