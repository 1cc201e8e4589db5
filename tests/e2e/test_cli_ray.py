"""The command line on Ray: a stop shuts the run's actors and its Ray runtime down, and a second
signal kills them; neither leaves a process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def marked(marker: str) -> list[int]:
    """Pids of the processes whose environment carries `marker` (the run and all Ray started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if f"GRPO_TEST_MARKER={marker}".encode() in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def start(tmp_path: Path, marker: str, *overrides: str) -> subprocess.Popen[str]:
    """The quickstart on a Ray runtime of its own (one actor: colocated), small steps."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline",
            "run",
            "recipes/quickstart.yaml",
            f"run.dir={tmp_path / 'run'}",
            "run.steps=1000",
            "model.threads=1",
            "placement.backend=ray",
            "prompts.prompts_per_step=8",
            "rollout.samples_per_prompt=4",
            "eval.every_steps=0",
            "gates.checks=[]",
            *overrides,
        ],
        cwd=ROOT,
        env={**os.environ, "RAY_AUTH_MODE": "disabled", "GRPO_TEST_MARKER": marker},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def read_until(process: subprocess.Popen[str], needle: str) -> str:
    """Output up to and including the first line containing `needle` (blocks on the pipe)."""
    assert process.stdout is not None
    seen = []
    for line in process.stdout:
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError(f"{needle!r} never printed; output:\n{''.join(seen)}")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_on_ray_leaves_no_ray_process_behind(tmp_path: Path, signum: signal.Signals) -> None:
    """Also by SIGTERM: Ray's driver handler for it reported a crash and ended the run by
    SIGABRT after the save, without its last line or gates.json."""
    marker = uuid.uuid4().hex
    gate = "gates.checks=[{metric: rollout/max_lag, stat: max, le: 1}]"
    with start(tmp_path, marker, gate) as process:
        try:
            output = read_until(process, "step 1/1000")
            # The driver, Ray's own processes (GCS, raylet, agents) and the actor's worker.
            assert len(marked(marker)) > 3, output
            process.send_signal(signum)
            output += process.communicate(timeout=600)[0]
        finally:
            process.kill()
    assert process.returncode == 0, output
    assert output.strip().splitlines()[-2].startswith("stopped after "), output
    assert "SIGTERM received at time" not in output  # Ray's crash report
    assert (tmp_path / "run" / "gates.json").is_file()
    assert marked(marker) == []


def test_a_second_signal_on_ray_takes_the_runtime_down_with_it(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    # Slow generation (1 s per request) keeps the drain going: only the second signal ends it.
    with start(tmp_path, marker, "run.stop_grace_s=600", "faults.engine_latency_s=1.0") as process:
        try:
            output = read_until(process, "step 1/1000")
            assert len(marked(marker)) > 3, output
            process.send_signal(signal.SIGTERM)
            output += read_until(process, "stopping admission")
            process.send_signal(signal.SIGTERM)
            output += process.communicate(timeout=300)[0]
        finally:
            process.kill()
    assert process.returncode == 128 + signal.SIGTERM, output
    assert marked(marker) == []
