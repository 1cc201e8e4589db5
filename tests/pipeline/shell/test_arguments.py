"""The command line's grammar: flags where people put them, --version, examples in --help."""

from __future__ import annotations

import pytest

from pipeline.shell.arguments import parse, version
from pipeline.shell.cli import COMMANDS


def parsed(*argv: str) -> dict[str, object]:
    namespace = vars(parse(COMMANDS, list(argv)))
    namespace.pop("handler")
    return namespace


def test_flags_go_between_and_after_the_overrides() -> None:
    assert parsed("run", "r.yaml", "--quiet", "run.steps=5", "--log-level", "warning", "run.seed=1") == {
        "command": "run",
        "recipe": "r.yaml",
        "overrides": ["run.steps=5", "run.seed=1"],
        "quiet": True,
        "log_level": "WARNING",
    }


def test_the_log_level_goes_before_or_after_the_command() -> None:
    assert parsed("--log-level", "debug", "validate", "r.yaml")["log_level"] == "DEBUG"
    assert parsed("--log-level=error", "validate", "r.yaml", "a.b=1")["log_level"] == "ERROR"
    assert parsed("validate", "r.yaml", "--log-level", "warning")["log_level"] == "WARNING"
    assert parsed("plot", "runs/a")["log_level"] == "INFO"


def test_generate_flags_before_the_model() -> None:
    args = parsed("generate", "--prompt", "12349=", "--top-p", "0.5", "runs/q/checkpoints/step-000010")
    assert (args["model"], args["prompt"], args["top_p"], args["max_new_tokens"]) == (
        "runs/q/checkpoints/step-000010",
        "12349=",
        0.5,
        None,
    )


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse(COMMANDS, ["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"grpo-pipeline {version()}\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["run"],
            "error: python -m pipeline run: the following arguments are required: RECIPE; "
            "e.g. python -m pipeline run recipes/quickstart.yaml (see python -m pipeline run --help)",
        ),
        (
            ["run", "r.yaml", "--quite"],
            "error: python -m pipeline run: unrecognized arguments: --quite; "
            "e.g. python -m pipeline run recipes/quickstart.yaml (see python -m pipeline run --help)",
        ),
        (
            ["--log-level", "loud", "validate", "r.yaml"],
            "error: python -m pipeline validate: argument --log-level: invalid choice: 'LOUD' "
            "(choose from 'DEBUG', 'INFO', 'WARNING', 'ERROR'); "
            "e.g. python -m pipeline validate recipes/quickstart.yaml "
            "(see python -m pipeline validate --help)",
        ),
        (
            [],
            "error: python -m pipeline: the following arguments are required: COMMAND; "
            "e.g. python -m pipeline run recipes/quickstart.yaml (see python -m pipeline --help)",
        ),
    ],
    ids=["run-without-recipe", "misspelt-flag", "bad-log-level", "no-command"],
)
def test_a_bad_command_line_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse(COMMANDS, argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == message + "\n"


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.name)
def test_every_help_shows_the_commands_examples(capsys: pytest.CaptureFixture[str], command) -> None:
    with pytest.raises(SystemExit):
        parse(COMMANDS, [command.name, "--help"])
    help_text = capsys.readouterr().out
    assert "examples:\n" + "".join(f"  {e}\n" for e in command.examples) in help_text
