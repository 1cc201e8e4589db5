"""The megatron backend on a GPU: megatron's DDP and distributed optimizer train a bf16 model
through float32 masters, and our CUDA engine serves the trained weights after each hand-off;
with `rollout.engine: megatron`, megatron's dynamic engine generates on the trained model itself.

Written on a CPU-only machine: not yet run (the lead runs `pytest -m gpu` on the H200)."""

from __future__ import annotations

import math

import anyio
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import pipeline  # noqa: E402
from backends.megatron.build import build_backend  # noqa: E402
from pipeline.metrics import read  # noqa: E402
from pipeline.shell.backend_input import backend_input  # noqa: E402
from tests.backends.megatron_cases import groups  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("colocated", [True, False])
async def test_bf16_steps_through_float32_masters_and_the_engine_serves_them(colocated: bool) -> None:
    recipe = pipeline.load_recipe(
        "recipes/quickstart.yaml",
        [
            "run.progress=false",
            "model.device=cuda",
            "model.dtype=bfloat16",
            f"colocated={str(colocated).lower()}",
        ],
    )
    engine, trainer = build_backend(backend_input(recipe), vocab_size=16, stop_ids=[1])
    try:
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        for _ in range(2):
            if colocated:
                await engine.stand_down()
            metrics = await trainer.train_step(groups(vocab=16))
            await (engine.wake() if colocated else engine.refit())
            assert metrics["train/applied_updates"] == recipe.train.updates_per_step  # of 3 groups
            assert all(math.isfinite(v) for v in metrics.values())
            assert engine.fingerprint() == trainer.fingerprint()
        changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
        assert changed and all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
        assert len(await engine.generate([3, 4, 5], 2)) == 2
    finally:
        engine.close()
        trainer.close()


async def test_a_saved_step_loads_into_a_fresh_backend_and_trains_on_alike(tmp_path) -> None:
    """The distributed optimizer's state goes through `dist_checkpointing` and back: the loaded
    trainer publishes exactly the saved weights and its next step matches the original's."""
    recipe = pipeline.load_recipe(
        "recipes/quickstart.yaml",
        ["run.progress=false", "model.device=cuda", "model.dtype=bfloat16", "colocated=false"],
    )
    engine, trainer = build_backend(backend_input(recipe), vocab_size=16, stop_ids=[1])
    try:
        await trainer.train_step(groups(vocab=16))
        trainer.save(tmp_path)
        saved = trainer.fingerprint()
        after = await trainer.train_step(groups(vocab=16))
    finally:
        engine.close()
        trainer.close()
    engine, trainer = build_backend(backend_input(recipe), vocab_size=16, stop_ids=[1])
    try:
        trainer.load(tmp_path)
        assert trainer.fingerprint() == saved
        again = await trainer.train_step(groups(vocab=16))
        assert again["train/loss"] == pytest.approx(after["train/loss"], rel=1e-3)
        assert again["train/grad_norm"] == pytest.approx(after["train/grad_norm"], rel=1e-2)
    finally:
        engine.close()
        trainer.close()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_megatron_inference_generates_colocated_on_the_trained_model(tmp_path, graphs: bool) -> None:
    """The quickstart, on-policy (L = 0), with megatron's dynamic engine: it stands down
    (suspend) for each step and wakes (resume) serving the new weights; its logprobs are the
    trainer's to bf16 rounding; evaluations (greedy) and checkpoints (its RNG) run too. With
    `rollout.graphs` its decode steps replay CUDA graphs captured once, over a KV cache whose
    memory goes back to the driver at each stand-down."""
    recipe = pipeline.load_recipe(
        "recipes/quickstart.yaml",
        [
            f"run.dir={tmp_path}",
            "run.steps=4",
            "run.progress=false",
            "run.plot=false",
            "model.device=cuda",
            "model.dtype=bfloat16",
            "train.backend=megatron",
            "rollout.engine=megatron",
            f"rollout.graphs={str(graphs).lower()}",
            "async_rl.max_lookahead_versions=0",
            "eval.every_steps=2",
            "eval.num_prompts=32",
            "checkpoint.every_steps=2",
        ],
    )
    summary = anyio.run(pipeline.run, recipe)
    assert summary.steps_done == 4 and not summary.stopped
    steps = [r for r in read(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for record in steps:
        assert all(math.isfinite(v) for v in record.values() if isinstance(v, float)), record
        assert record["train/applied_updates"] == recipe.train.updates_per_step, record
        assert record["train/grad_norm"] > 0, record
        assert record["timing/stand_down_s"] >= 0 and record["timing/wake_s"] >= 0, record
        assert record["rollout/poisoned_samples"] == 0 and record["rollout/max_lag"] == 0, record
        assert record["train/token_mult_prob_error"] < 1.05, record
    evals = read(tmp_path / "eval.jsonl")
    assert {r["step"] for r in evals} >= {0, 2, 4}
    assert all(math.isfinite(r["eval/reward"]) for r in evals)
