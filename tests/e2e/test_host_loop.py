"""Embedded in a host's event loop, a real run never holds the loop for long: the host's
heartbeat is measured over the whole run, from `load_recipe` to the report's PNG.

The host raises its own priority where it may: on a machine shared with other busy processes
the scheduler's delays (tens of ms) would otherwise read as the pipeline's own stalls."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]

# A host that already uses torch (so its import, which no thread can hide, is not counted), with
# a heartbeat every 5 ms beside a short quickstart: evaluations, a checkpoint, the report.
HOST = """
import asyncio, json, os, sys, time
import torch
import pipeline

try:
    os.nice(-10)
except PermissionError:
    pass  # measured at the normal priority then

async def main(run_dir):
    gaps, done = [], False

    async def heartbeat():
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last - 0.005)
            last = now

    beat = asyncio.create_task(heartbeat())
    await asyncio.sleep(0.05)
    overrides = ["run.steps=8", f"run.dir={run_dir}", "eval.every_steps=4", "eval.num_prompts=64",
                 "checkpoint.every_steps=4", "run.plot=true"]
    recipe = await asyncio.to_thread(pipeline.load_recipe, "recipes/quickstart.yaml", overrides)
    summary = await pipeline.run(recipe)
    done = True
    await beat
    print(json.dumps({"steps": summary.steps_done, "worst_ms": sorted(gaps)[-3:][::-1]}))

asyncio.run(main(sys.argv[1]))
"""


def test_no_stall_above_50_ms_over_a_whole_run(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", HOST, str(tmp_path / "run")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["steps"] == 8
    assert (tmp_path / "run" / "report.png").is_file()
    worst_ms = [round(gap * 1000, 1) for gap in result["worst_ms"]]
    assert worst_ms[0] < 50, f"the event loop stalled for {worst_ms} ms"
