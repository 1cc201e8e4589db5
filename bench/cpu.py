"""CPU benchmark: seconds per GRPO step on the reverse-digits recipe, and its parts.

Runs `recipes/reverse-digits.yaml` (2 layers, width 128, 32 prompts x 8 samples per step) for a
fixed number of steps without evaluation, for each pipeline mode, in one process one after the
other, and writes the medians to bench/results-cpu.json. Steps 1-5 are warm-up and excluded.

    python -m bench.cpu [--steps 60] [key.path=value ...]
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

MODES = {
    "colocated L=0": ["colocated=true", "async_rl.max_lookahead_versions=0"],
    "colocated L=1": ["colocated=true", "async_rl.max_lookahead_versions=1"],
    "separate L=1": ["colocated=false", "async_rl.max_lookahead_versions=1"],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="bench/results-cpu.json")
    parser.add_argument("overrides", nargs="*", help="recipe overrides applied to every mode")
    args = parser.parse_args()
    results = {}
    for mode, overrides in MODES.items():
        with tempfile.TemporaryDirectory() as tmp:
            recipe = pipeline.load_recipe(
                "recipes/reverse-digits.yaml",
                [
                    *overrides,
                    *args.overrides,
                    f"run.steps={args.steps}",
                    f"run.dir={tmp}/run",
                    "eval.every_steps=0",
                ],
            )
            start = time.perf_counter()
            anyio.run(pipeline.run, recipe)
            wall = time.perf_counter() - start
            records = [r for r in read(Path(tmp) / "run" / "metrics.jsonl") if "train/loss" in r][5:]
        results[mode] = {
            "overrides": args.overrides,
            "step_s_median": statistics.median(r["timing/step_s"] for r in records),
            "train_s_median": statistics.median(r["timing/train_s"] for r in records),
            "wall_s": wall,
            "steps": args.steps,
        }
        print(mode, json.dumps(results[mode]))
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
