"""`python -m bench.long_tail`: the end-to-end comparison of long-tailed lengths against a reference
run. Its figures come from the steps asked for only, its ratios are each run's over the first
run's, it writes its section beside the file's others, and a run that does not log its steps in
time is stopped and named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.long_tail import summarize

ROOT = Path(__file__).parents[2]


def _step(step: int, tokens: float, seconds: float, samples: int = 4, **more: float) -> dict[str, float]:
    line = {
        "step": step,
        "timing/step_s": seconds,
        "throughput/tokens_per_s_per_gpu": tokens / seconds,
        "train/tokens": tokens,
        "timing/train_s": seconds / 2,
        "train/token_mult_prob_error": 1.0 + step**2 / 100,
        "train/gen_kl_error": step / 1000,
        "rollout/max_lag": step % 2,
        "rollout/response_len": tokens / samples,
        "rollout/samples": samples,
        "rollout/response_len_p50": step,
        "rollout/response_len_p90": 2 * step,
        "rollout/response_len_max": 3 * step,
    }
    return {**line, **more}


def test_the_figures_are_those_of_the_steps_asked_for() -> None:
    # Step 1 (compiling) is slow and odd; steps 2-4 carry 300, 100 and 200 tokens in 3, 1 and 1 s,
    # in 2, 4 and 4 samples.
    steps = [_step(1, 10, 50.0, **{"timing/decode_step_ms": 9.0}), _step(2, 300, 3.0, samples=2)]
    steps += [
        _step(3, 100, 1.0, **{"timing/loop_s": 1.0}),
        _step(4, 200, 1.0, **{"train/compiled_graphs": 1.0}),
    ]
    for line in steps[1:]:
        line["timing/decode_step_ms"] = 3.0
    figures = summarize(steps, 2, 4)
    assert figures["steps"] == [2, 4]
    assert figures["tokens_per_s"] == pytest.approx(600 / 5)  # over the seconds, not a mean of rates
    assert figures["training_tokens_per_s"] == pytest.approx(600 / 2.5)
    assert figures["tokens_a_step"] == pytest.approx(200)
    assert figures["decode_step_ms"] == 3.0
    assert figures["token_mult_prob_error"] == pytest.approx(1.09)  # the median of 1.04, 1.09, 1.16
    assert figures["gen_kl_error"] == pytest.approx(0.003)
    assert figures["max_lag"] == 1 and figures["compiled_graphs"] == 1
    assert figures["trained_lengths"] == {
        "mean": pytest.approx(600 / 10),  # a sample's mean length, not a step's
        "p50_mean_of_steps": 3.0,
        "p90_mean_of_steps": 6.0,
        "max": 12,
    }
    assert "loop_s" not in figures  # a metric some step lacks (no decode loop there) is left out
    with pytest.raises(ValueError, match="no step from 5 to 9"):
        summarize(steps, 5, 9)


def _bench(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    out = [] if "--out" in args else ["--out", str(tmp_path / "results.json")]  # never the repo's
    command = [sys.executable, "-m", "bench.long_tail", "--dir", str(tmp_path / "runs"), *out, *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_two_quickstart_runs_and_their_ratio(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"earlier": {"kept": True}}, indent=2) + "\n")
    partial = "rollout.partial=true async_rl.max_lookahead_versions=1"
    done = _bench(
        tmp_path, "--steps", "3", "--first", "2", "--out", str(out), "--section", "now",
        "--run", "fixed recipes/quickstart.yaml async_rl.max_lookahead_versions=0",
        "--run", f"partial recipes/quickstart.yaml {partial}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    assert text.startswith('{\n  "earlier"')  # the file's sections and indentation kept
    runs = json.loads(text)["now"]["runs"]
    assert list(runs) == ["fixed", "partial"]
    assert runs["fixed"]["over_reference"] == 1.0
    for name, figures in runs.items():
        metrics = (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
        lines = [json.loads(line) for line in metrics]
        chosen = [line for line in lines if line.get("step") in (2, 3) and "timing/step_s" in line]
        assert figures["tokens_per_s"] == pytest.approx(summarize(chosen, 2, 3)["tokens_per_s"])
        assert figures["steps"] == [2, 3]
    assert runs["partial"]["max_lag"] <= 1 and runs["fixed"]["max_lag"] == 0
    ratio = runs["partial"]["tokens_per_s"] / runs["fixed"]["tokens_per_s"]
    assert runs["partial"]["over_reference"] == pytest.approx(ratio)


def test_an_earlier_run_in_the_directory_is_refused(tmp_path: Path) -> None:
    earlier = tmp_path / "runs" / "fixed"
    earlier.mkdir(parents=True)
    (earlier / "metrics.jsonl").write_text(json.dumps(_step(1, 10, 1.0)) + "\n")
    done = _bench(tmp_path, "--steps", "1", "--first", "1", "--run", "fixed recipes/quickstart.yaml")
    assert done.returncode != 0 and "holds an earlier run" in done.stderr, done.stderr[-2000:]


def test_a_run_past_its_limit_is_stopped_and_named(tmp_path: Path) -> None:
    done = _bench(
        tmp_path, "--steps", "3", "--first", "2", "--limit-s", "0.2", "--out", str(tmp_path / "r.json"),
        "--run", "slow recipes/quickstart.yaml",
    )  # fmt: skip
    assert done.returncode != 0
    assert "slow: 0 of 3 steps logged" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "r.json").exists()
