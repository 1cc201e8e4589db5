"""The report's words and scale: a title that says which run, how long and how it ended; the
seconds-per-step axis at the steady state; 'per GPU' only where a GPU ran."""

from __future__ import annotations

from pathlib import Path

from pipeline.shell.plot import headline, on_gpu, steady_top


def test_the_title_names_the_run_its_length_and_final_rewards() -> None:
    steps = [{"step": s, "timing/step_s": 0.5, "reward/mean": 0.25 * s} for s in (1, 2, 3, 4)]
    evals = [{"step": 0, "eval/reward": 0.0, "timing/eval_s": 1.0}, {"step": 4, "eval/reward": 0.875}]
    assert headline("quickstart", steps, evals) == (
        "quickstart: 4 steps in 3.0 s, final reward 1.00 (train), 0.88 (held-out, step 4)"
    )
    assert headline("one", steps[:1], []) == "one: 1 step in 0.5 s, final reward 0.25 (train)"


def test_slow_first_steps_run_off_the_top_of_the_step_time_axis() -> None:
    steps = [{"step": s, "timing/step_s": 9.0 if s <= 3 else 0.1} for s in range(1, 101)]
    assert steady_top(steps) == 1.5 * 0.1
    assert steady_top(steps[:5]) is None  # too few steps to tell a steady state


def test_per_gpu_only_for_runs_on_a_gpu(tmp_path: Path) -> None:
    (tmp_path / "recipe.yaml").write_text("model:\n  device: cuda\n")
    assert on_gpu(tmp_path)
    (tmp_path / "recipe.yaml").write_text("model:\n  device: cpu\n")
    assert not on_gpu(tmp_path)
