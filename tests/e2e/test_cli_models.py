"""`export` and `generate` in a subprocess: a checkpoint out as a Hugging Face directory, and
one prompt completed from either, with ids and logprobs as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from stages.checkpoint import committed

ROOT = Path(__file__).parents[2]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_export_then_generate_json_from_checkpoint_and_export_agree(tiny_qwen2_run, tmp_path: Path) -> None:
    _, run_dir = tiny_qwen2_run
    (checkpoint,) = committed(run_dir / "checkpoints")
    exported = cli("export", str(checkpoint), str(tmp_path / "hf"))
    assert exported.returncode == 0, exported.stderr
    assert exported.stdout == f"exported {checkpoint} to {tmp_path / 'hf'}\n"

    args = ["--prompt", "What is 3 + 4?", "--chat", "--max-new-tokens", "6", "--json"]
    results = []
    for model in (checkpoint, tmp_path / "hf"):
        done = cli("generate", str(model), *args)
        assert done.returncode == 0, done.stderr
        results.append(json.loads(done.stdout))
    assert results[0] == results[1]
    result = results[0]
    assert set(result) == {"text", "prompt_tokens", "tokens", "logprobs", "finish_reason"}
    assert 1 <= len(result["tokens"]) <= 6
    assert len(result["logprobs"]) == len(result["tokens"])
    assert all(lp <= 0 for lp in result["logprobs"])

    plain = cli("generate", str(tmp_path / "hf"), *args[:-1])
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == result["text"] + "\n"


def test_generate_from_a_missing_directory_exits_2(tmp_path: Path) -> None:
    done = cli("generate", str(tmp_path / "nope"), "--prompt", "hi")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'nope'}: neither a checkpoint (trainer.pt and recipe.yaml) "
        "nor a Hugging Face model directory (config.json)"
    )


def test_exporting_a_model_with_learned_positions_is_a_one_line_error(tmp_path: Path) -> None:
    overrides = [f"run.dir={tmp_path / 'run'}", "run.steps=1", "eval.every_steps=0", "run.plot=false"]
    overrides += ["gates.checks=[]"]  # the recipe's gates need 100 steps
    run = cli("run", "recipes/reverse-digits.yaml", *overrides, "--quiet")
    assert run.returncode == 0, run.stderr
    (checkpoint,) = committed(tmp_path / "run" / "checkpoints")
    exported = cli("export", str(checkpoint), str(tmp_path / "hf"))
    assert exported.returncode == 2
    assert exported.stderr == (
        f"error: {checkpoint}: a model with learned_position_embeddings has no Hugging Face "
        "Llama/Qwen2 equivalent and cannot be exported\n"
    )
    assert not (tmp_path / "hf").exists()
