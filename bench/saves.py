"""What checkpoint saves cost a run's steps: one run of a recipe, its step-time figures as JSON.

Runs the recipe (default: the CPU quickstart) in a temporary run.dir with the given overrides,
then prints one JSON line: the median (and mean) seconds per step over steps after the warm-up, the
saving steps' median `timing/save_s` (what the step waited: the snapshot, and any wait for the
previous write) and `timing/save_write_s` (the background write), and the run's wall seconds.
Run it twice side by side, with and without saves, alternating, e.g.

    python -m bench.saves checkpoint.every_steps=10 run.steps=60   # versus every_steps=0

On the GPU machine, the 1.5B colocated recipe with a save every 2 steps against none:

    python -m bench.saves --recipe recipes/<1.5B recipe>.yaml checkpoint.every_steps=2 run.steps=10
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import anyio

import pipeline
from pipeline.metrics import read

WARMUP = 2  # steps whose time includes first-call compilation and allocation
_PER_STEP = ("timing/step_s", "timing/save_s", "timing/save_wait_s", "timing/save_write_s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="recipes/quickstart.yaml")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        recipe = pipeline.load_recipe(
            args.recipe,
            [
                f"run.dir={tmp}/run",
                "run.plot=false",
                "run.progress=false",
                "gates.checks=[]",
                *args.overrides,
            ],
        )
        start = time.perf_counter()
        anyio.run(pipeline.run, recipe)
        wall = time.perf_counter() - start
        records = [r for r in read(Path(tmp) / "run" / "metrics.jsonl") if "timing/step_s" in r]

    def median(key: str, rows: list[dict[str, float]]) -> float | None:
        values = [r[key] for r in rows if key in r]
        return statistics.median(values) if values else None

    steady = records[WARMUP:]
    print(
        json.dumps(
            {
                "overrides": args.overrides,
                "steps": len(records),
                "step_s_median": median("timing/step_s", steady),
                "step_s_mean": statistics.fmean(r["timing/step_s"] for r in steady),
                "step_s_median_saving_steps": median(
                    "timing/step_s", [r for r in steady if "timing/save_s" in r]
                ),
                "save_s_median": median("timing/save_s", steady),
                "save_wait_s_median": median("timing/save_wait_s", steady),
                "save_write_s_median": median("timing/save_write_s", steady),
                "wall_s": wall,
                "per_step": [
                    {k.removeprefix("timing/"): round(r[k], 3) for k in _PER_STEP if k in r} for r in records
                ],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
