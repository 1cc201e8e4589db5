"""The command line in a subprocess: exit codes, one-line errors, a real tiny run, signals."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.metrics import REQUIRED_KEYS
from stages.checkpoint import committed

ROOT = Path(__file__).parents[2]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"

METRIC_KEYS = REQUIRED_KEYS  # docs/DESIGN.md, "What a run leaves behind"
# Small and fast; without the quickstart's gates, which a run this short fails.
SMALL = [
    "prompts.prompts_per_step=8",
    "rollout.samples_per_prompt=4",
    "eval.every_steps=0",
    "gates.checks=[]",
]
PASSING = "gates.checks=[{metric: rollout/max_lag, stat: max, le: 1}]"  # L = 1: always true
FAILING = (  # the second cannot pass: rewards are at most 1
    "gates.checks=[{metric: rollout/max_lag, stat: max, le: 1}, "
    "{metric: reward/mean, stat: at, step: 1, gt: 2}]"
)


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def read_until(process: subprocess.Popen[str], needle: str) -> list[str]:
    """Lines of output up to and including the first one containing `needle` (blocks on the pipe)."""
    assert process.stdout is not None
    seen = []
    for line in process.stdout:
        seen.append(line)
        if needle in line:
            return seen
    raise AssertionError(f"{needle!r} never printed; output:\n{''.join(seen)}")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "run:\n  stepz: 3\n",
            "run.stepz: unknown field (did you mean `steps`?); valid fields: "
            "dir, steps, seed, stop_grace_s, progress, log_every_steps, plot",
        ),
        (
            "run:\n  steps: [\n",
            "invalid YAML: line 3, column 1: expected the node content, but found '<stream end>'",
        ),
        # "\udcff" is written as the byte 0xff (surrogateescape): a file in Latin-1, say.
        ("run:\n  dir: caf\udcff\n", "not UTF-8 text: byte 0xff at line 2, column 11; save it as UTF-8"),
        ("train:\n  lr: .inf\n", "train.lr: Expected a finite number, got inf"),
    ],
    ids=["unknown-key", "yaml-syntax", "not-utf8", "lr-inf"],
)
@pytest.mark.parametrize("command", ["validate", "run"])
def test_bad_recipe_exits_2_with_one_line(tmp_path: Path, command: str, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    result = cli(command, str(path))
    assert result.returncode == 2
    assert result.stderr == f"error: {path}: {message}\n"
    assert "Traceback" not in result.stdout + result.stderr


def test_validate_missing_file_and_bad_override(tmp_path: Path) -> None:
    missing = cli("validate", str(tmp_path / "nope.yaml"))
    assert (missing.returncode, missing.stderr) == (
        2,
        f"error: {tmp_path / 'nope.yaml'}: recipe file not found\n",
    )
    bad = cli("validate", str(QUICKSTART), "run.steps")
    assert (bad.returncode, bad.stderr) == (
        2,
        "error: override 'run.steps': expected key.path=value, e.g. run.steps=20\n",
    )


def test_validate_good_recipe_exits_0(tmp_path: Path) -> None:
    # Its own run.dir: validate, like run, refuses the recipe once runs/quickstart has finished.
    result = cli("validate", str(QUICKSTART), f"run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{QUICKSTART}: ok\n"


def test_small_real_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = cli("run", str(QUICKSTART), "run.steps=3", f"run.dir={run_dir}", *SMALL, PASSING, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    # What start-up is doing, said as it starts (a timestamp first), with the console's lines
    # (wrapped to 80 columns: a continuation is indented).
    lines: list[str] = []
    for line in result.stdout.splitlines():
        if line.startswith("    ") and lines:
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
    assert all(len(line) <= 80 for line in result.stdout.splitlines()[:-2])  # the console's
    assert [line.partition(" ")[2] for line in lines[:3]] == [
        f"starting a run of 3 steps in {run_dir}",
        "loading torch",
        "building the model (train.backend torch, model.device cpu)",
    ]
    assert result.stdout.splitlines()[-2:] == [
        f"finished after 3 steps (policy version 3); run dir {run_dir}",
        f"gates: all 1 passed (see {run_dir}/gates.json)",
    ]
    assert "gate passed: max(rollout/max_lag) = 1 (needs <= 1)\n" in result.stderr
    assert {"recipe.yaml", "metrics.jsonl", "trace.json", "gates.json"} <= {p.name for p in run_dir.iterdir()}

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in metrics.jsonl")

    lines = [
        json.loads(line, parse_constant=refuse)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in lines] == [1, 2, 3]
    for line in lines:
        assert METRIC_KEYS <= set(line), METRIC_KEYS - set(line)
        assert all(math.isfinite(v) for v in line.values() if isinstance(v, float))
    assert json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    # Rerunning the finished run as it is would train nothing: refused, and nothing changes.
    again = cli("run", str(QUICKSTART), "run.steps=3", f"run.dir={run_dir}", *SMALL, "--quiet", timeout=600)
    assert again.returncode == 2, again.stdout + again.stderr
    assert again.stderr.splitlines()[-1] == (
        f"error: run.steps: 3, but the run in {run_dir} has trained 3 steps (checkpoint step-000003); "
        "set run.steps above 3 to train more, or choose another run.dir"
    )
    assert "Traceback" not in again.stderr and "trace.1.json" not in {p.name for p in run_dir.iterdir()}


def test_a_second_run_on_the_same_run_dir_exits_2_naming_the_first(tmp_path: Path) -> None:
    from stages.run_dir import RunDirLock

    run_dir = tmp_path / "run"
    holder = RunDirLock(run_dir)
    holder.acquire()
    try:
        result = cli("run", str(QUICKSTART), f"run.dir={run_dir}", *SMALL, "--quiet", timeout=600)
        who = holder.path.read_text().strip()
    finally:
        holder.release()
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"error: run.dir: {run_dir} is in use by {who}; wait for that run to end or choose another run.dir"
    )
    assert "Traceback" not in result.stderr


def nan_reward(prompt: object, completion: str) -> float:
    """`reward.function: tests.e2e.test_cli_errors:nan_reward`: never a usable reward."""
    return math.nan


def test_a_reward_that_is_always_nan_ends_the_run_with_exit_1(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    reward = "reward.function=tests.e2e.test_cli_errors:nan_reward"
    result = cli("run", str(QUICKSTART), f"run.dir={run_dir}", reward, *SMALL, "--quiet", timeout=600)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.splitlines()[-1] == (
        "error: 65 reward failures, over reward.max_failures=64; last: NonFiniteReward: "
        "reward function returned non-finite values: {'reward': nan}"
    )
    assert "Traceback" not in result.stderr and "finished" not in result.stdout


def test_failed_gates_exit_3_and_check_reads_the_resumed_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    base = [
        "run",
        str(QUICKSTART),
        f"run.dir={run_dir}",
        *SMALL,
        FAILING,
        "checkpoint.every_steps=1",
    ]
    first = cli(*base, "run.steps=2", "--quiet", timeout=600)
    assert first.returncode == 3, first.stdout + first.stderr
    assert first.stdout.splitlines()[-2:] == [
        f"finished after 2 steps (policy version 2); run dir {run_dir}",
        f"gates: 1 of 2 failed (see {run_dir}/gates.json)",
    ]
    assert re.search(
        r"WARNING stages.gates: gate FAILED: at\(reward/mean, step 1\) = [0-9.e-]+ \(needs > 2\)\n",
        first.stderr,
    )
    verdict = json.loads((run_dir / "gates.json").read_text())
    assert [(r["gate"], r["passed"]) for r in verdict["results"]] == [
        ("max(rollout/max_lag)", True),
        ("at(reward/mean, step 1)", False),
    ]
    assert not verdict["passed"]

    # Resumed from step 2 to 3; gates.fail: false reports the failure but exits 0.
    second = cli(*base, "run.steps=3", "gates.fail=false", "--quiet", timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resumed from" in second.stderr
    assert second.stdout.splitlines()[-1] == f"gates: 1 of 2 failed (see {run_dir}/gates.json)"

    # check: the run's own recipe (its gates fail), then another recipe's (they pass), running nothing.
    own = cli("check", str(run_dir))
    assert own.returncode == 3, own.stdout + own.stderr
    lines = own.stdout.splitlines()
    assert lines[0] == "gate passed: max(rollout/max_lag) = 1 (needs <= 1)"
    assert lines[1].startswith("gate FAILED: at(reward/mean, step 1) = ") and lines[1].endswith(
        " (needs > 2)"
    )
    assert lines[2:] == ["gates: 1 of 2 failed"]
    other = tmp_path / "other.yaml"
    other.write_text(
        "gates:\n  checks:\n    - {metric: step, stat: last, ge: 3}\n"
        "    - {metric: rollout/max_lag, stat: max, le: 1}\n"
    )
    passing = cli("check", str(run_dir), "--recipe", str(other))
    assert (passing.returncode, passing.stdout.splitlines()[-1]) == (0, "gates: all 2 passed"), passing.stderr
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == 3


def test_check_bad_input_exits_2(tmp_path: Path) -> None:
    nowhere = cli("check", str(tmp_path))
    assert (nowhere.returncode, nowhere.stderr) == (
        2,
        f"error: {tmp_path}: no metrics.jsonl here: not a run directory\n",
    )
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "recipe.yaml").write_text("run:\n  steps: 3\n")
    no_gates = cli("check", str(tmp_path))
    assert (no_gates.returncode, no_gates.stderr) == (
        2,
        f"error: {tmp_path / 'recipe.yaml'}: gates.checks: the recipe has no gates "
        "(give one with --recipe)\n",
    )
    missing = cli("check", str(tmp_path), "--recipe", str(tmp_path / "nope.yaml"))
    assert (missing.returncode, missing.stderr) == (
        2,
        f"error: {tmp_path / 'nope.yaml'}: recipe file not found\n",
    )


def test_sigterm_stops_cleanly(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # The second gate could never pass at step 900; a stop short of it skips it, so exit 0.
    gates = (
        "gates.checks=[{metric: rollout/max_lag, stat: max, le: 1}, "
        "{metric: reward/mean, stat: at, step: 900, gt: 2}]"
    )
    process = start(
        "run", str(QUICKSTART), "run.steps=1000", f"run.dir={run_dir}", "run.stop_grace_s=120", *SMALL, gates
    )
    try:
        read_until(process, "step 1/1000")
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=600)
    finally:
        process.kill()
    assert process.returncode == 0, output
    assert "SIGTERM received: stopping admission" in output
    last, verdict = output.strip().splitlines()[-2:]
    assert last.startswith("stopped after ") and last.endswith(f"run dir {run_dir}"), output
    assert verdict == f"gates: all 1 passed, 1 skipped (see {run_dir}/gates.json)"
    assert "Traceback" not in output
    # The stop saved a committed checkpoint at the step it stopped at.
    steps = int(last.split()[2])
    assert (
        f"gate skipped: at(reward/mean, step 900): step 900 is past step {steps}, where the run stopped"
        in output
    )
    assert [p.name for p in committed(run_dir / "checkpoints")] == [f"step-{steps:06d}"]
    # check gives the stopped run the verdict the run gave itself: the unreached gate skipped.
    checked = cli("check", str(run_dir))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.splitlines()[-2:] == [
        f"gate skipped: at(reward/mean, step 900): step 900 is past step {steps}, where the run stopped "
        "(needs > 2)",
        "gates: all 1 passed, 1 skipped",
    ]


def test_second_signal_exits_at_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # Slow generation (1 s per request, real time) keeps the drain going for many seconds.
    process = start(
        "run",
        str(QUICKSTART),
        "run.steps=1000",
        f"run.dir={run_dir}",
        "run.stop_grace_s=600",
        "faults.engine_latency_s=1.0",
        *SMALL,
    )
    try:
        read_until(process, "step 1/1000")
        process.send_signal(signal.SIGTERM)
        read_until(process, "stopping admission")
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=300)
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGTERM, output
    assert "second SIGTERM: exiting now" in output
    assert "stopped after" not in output
    assert os.path.isdir(run_dir)
