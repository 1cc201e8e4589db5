"""Embedded in a host's event loop, a real run keeps its heavy work off the loop, and says what it
is doing while it starts.

Over a whole run (from `load_recipe` to the report's PNG) no heavy package is first imported on
the loop's thread: torch, its native libraries and the model are brought up on worker threads,
the report is drawn by a child process. How long the loop is ever held is a figure of the
machine as much as of the pipeline, so it is measured by `python -m bench.host_loop`
(bench/results-cpu.json), not here: a timed test fails on a busy machine and passes on an idle
one whatever the code does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]

# A host that has not imported torch, beside a short quickstart: evaluations, a checkpoint, the
# report. An audit hook sees every first import of a module; those on the loop's thread (the
# main one) are kept, and the pipeline's info lines, in order.
HOST = """
import asyncio, json, logging, sys, threading
import pipeline

HEAVY = {"torch", "numpy", "matplotlib", "transformers", "safetensors", "sympy", "ray", "megatron", "wandb"}
on_loop = []

def audit(event, args):
    if event == "import" and threading.current_thread() is threading.main_thread():
        if args[0].partition(".")[0] in HEAVY:
            on_loop.append(args[0])

class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.seen = []

    def emit(self, record):
        if record.name.partition(".")[0] in ("pipeline", "stages", "backends"):
            self.seen.append(record.getMessage())

lines = Lines()
logging.getLogger().addHandler(lines)
logging.getLogger().setLevel(logging.INFO)

async def main(run_dir):
    overrides = ["run.steps=4", f"run.dir={run_dir}", "eval.every_steps=2", "eval.num_prompts=16",
                 "prompts.prompts_per_step=4", "checkpoint.every_steps=2", "run.plot=true"]
    recipe = await asyncio.to_thread(pipeline.load_recipe, "recipes/quickstart.yaml", overrides)
    sys.addaudithook(audit)
    summary = await pipeline.run(recipe)
    print(json.dumps({"steps": summary.steps_done, "on_loop": sorted(set(on_loop)), "lines": lines.seen}))

asyncio.run(main(sys.argv[1]))
"""


def test_a_run_imports_nothing_heavy_on_the_hosts_loop_and_says_what_it_starts(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", HOST, str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["steps"] == 4
    assert (tmp_path / "run" / "report.png").is_file()
    assert result["on_loop"] == []
    said = [line for line in result["lines"] if not line.startswith("gate ")]
    assert said[:4] == [
        f"starting a run of 4 steps in {tmp_path / 'run'}",
        "loading torch",
        "building the model (train.backend torch, model.device cpu)",
        "evaluating the starting weights on the held-out prompts",
    ]
    assert said[-1] == f"drawing {tmp_path / 'run' / 'report.png'}"
