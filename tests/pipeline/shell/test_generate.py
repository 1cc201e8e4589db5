"""`generate` and `export` on the checkpoints of the built-in digit tasks: defaults from the
model, one-line errors for arguments it cannot use, a tokenizer beside an exported model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import anyio
import pytest
import torch

import pipeline
from pipeline.shell.cli import main
from stages.checkpoint import committed

QUICKSTART = Path(__file__).parents[3] / "recipes" / "quickstart.yaml"
TINY = ["run.steps=1", "prompts.prompts_per_step=2", "rollout.samples_per_prompt=2", "eval.every_steps=0"]


def checkpoint_of(root: Path, *overrides: str) -> Path:
    recipe = pipeline.load_recipe(QUICKSTART, [*TINY, "run.plot=false", f"run.dir={root}", *overrides])
    anyio.run(pipeline.run, recipe)
    (checkpoint,) = committed(root / "checkpoints")
    return checkpoint


@pytest.fixture(scope="module")
def learned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A quickstart checkpoint: learned position table of 32, trained on 5 new tokens."""
    return checkpoint_of(tmp_path_factory.mktemp("learned"))


@pytest.fixture(scope="module")
def rotary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same without the learned positions, so it can be exported."""
    return checkpoint_of(tmp_path_factory.mktemp("rotary"), "model.config.learned_position_embeddings=false")


def cli(capfd: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`main(argv)` in this process: (exit code, stdout, stderr); the root logger as it was."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        code = main(list(argv))
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    out, err = capfd.readouterr()
    return code, out, err


def test_defaults_generate_as_many_tokens_as_the_run_did(
    learned: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = cli(capfd, "generate", str(learned), "--prompt", "12349=", "--json")
    assert code == 0
    result = json.loads(out)
    assert len(result["tokens"]) <= 5  # not 128, which overflows the 32 positions


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--top-p", "0"], "--top-p: must be in (0, 1] (1 keeps every token), got 0"),
        (["--temperature", "-1"], "--temperature: must be >= 0 (0 is greedy), got -1"),
        (["--max-new-tokens", "0"], "--max-new-tokens: must be >= 1, got 0"),
        (
            ["--max-new-tokens", "128"],
            "--max-new-tokens: 128 new tokens after a prompt of 7 exceed the model's 32 positions "
            "(learned position embeddings); give at most 25",
        ),
        pytest.param(
            ["--device", "cuda"],
            f"--device: 'cuda', but this torch ({torch.__version__}) is a CPU build; "
            "install a CUDA build of torch, or use cpu",
            marks=pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU build of torch"),
        ),
    ],
    ids=["top-p-0", "negative-temperature", "no-tokens", "past-the-position-table", "cuda-on-cpu-torch"],
)
def test_arguments_it_cannot_use_are_one_line_errors(
    learned: Path, capfd: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    done = cli(capfd, "generate", str(learned), "--prompt", "12349=", *flags)
    assert done == (2, "", f"error: {message}\n")


def test_an_exported_digit_model_generates_as_its_checkpoint(
    rotary: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "hf"
    assert cli(capfd, "export", str(rotary), str(out_dir))[0] == 0
    assert json.loads((out_dir / "generation_config.json").read_text())["max_new_tokens"] == 5
    results = [
        cli(capfd, "generate", str(model), "--prompt", "12349=", "--json", "--log-level", "error")
        for model in (rotary, out_dir)
    ]
    assert results[0] == results[1]
    assert results[0][0] == 0


def test_export_refuses_a_directory_that_is_not_empty(
    rotary: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    assert cli(capfd, "export", str(rotary), str(tmp_path)) == (
        2,
        "",
        f"error: {tmp_path}: not an empty directory; export into a new or empty one\n",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_plot_of_several_runs_needs_an_out_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli(capfd, "plot", "runs/a", "runs/b") == (
        2,
        "",
        "error: plot: several runs need --out, e.g. --out compare.png\n",
    )
    assert list(tmp_path.iterdir()) == []
