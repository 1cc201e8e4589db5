"""CPU benchmark: seconds per GRPO step on the reverse-digits recipe, optionally side by side
with Hugging Face TRL's `GRPOTrainer` on the same task and model shape.

Runs `recipes/reverse-digits.yaml` (2 layers, width 128, 32 prompts x 8 samples per step) for a
fixed number of steps without evaluation, for each pipeline mode, in one process one after the
other; steps 1-5 are warm-up and excluded. With `--trl PYTHON` (a Python that has TRL, see
bench/trl_reverse.py), each round also runs TRL's benchmark in a subprocess, interleaved with
ours, so that both see the same machine (a shared 2-core VM drifts by 20% over minutes). Writes
the per-round and overall medians, and TRL's over ours, to bench/results-cpu.json.

    python -m bench.cpu [--steps 60] [--rounds 3] [--modes "colocated L=0,..."]
                        [--trl /tmp/trlvenv/bin/python] [key.path=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

import pipeline
from pipeline.metrics import read

MODES = {
    "colocated L=0": ["colocated=true", "async_rl.max_lookahead_versions=0"],
    "colocated L=1": ["colocated=true", "async_rl.max_lookahead_versions=1"],
    "separate L=1": ["colocated=false", "async_rl.max_lookahead_versions=1"],
}
WARMUP = 5


def ours(
    overrides: list[str], steps: int, *, recipe: str = "recipes/reverse-digits.yaml"
) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        loaded = pipeline.load_recipe(
            recipe,
            # No gates: the recipe's are on-policy ones, which the L=1 modes are not meant to meet.
            [
                *overrides,
                f"run.steps={steps}",
                f"run.dir={tmp}/run",
                "eval.every_steps=0",
                "run.plot=false",
                "gates.checks=[]",
            ],
        )
        start = time.perf_counter()
        anyio.run(pipeline.run, loaded)
        wall = time.perf_counter() - start
        records = read(Path(tmp) / "run" / "metrics.jsonl")[WARMUP:]
    return {
        "step_s_median": statistics.median(r["timing/step_s"] for r in records),
        "train_s_median": statistics.median(r["timing/train_s"] for r in records),
        "wall_s": wall,
    }


def trl(python: str, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trl.json"
        command = [python, "bench/trl_reverse.py", "--steps", str(steps), "--warmup", str(WARMUP)]
        subprocess.run([*command, "--out", str(out)], check=True, capture_output=True)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--trl", help="a Python interpreter with TRL installed (bench/trl_reverse.py)")
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated subset of: " + ", ".join(MODES)
    )
    parser.add_argument("--out", default="bench/results-cpu.json")
    parser.add_argument("overrides", nargs="*", help="recipe overrides applied to every mode")
    args = parser.parse_args()
    modes = {name: MODES[name] for name in args.modes.split(",")}
    rounds: list[dict[str, Any]] = []
    for index in range(args.rounds):
        result: dict[str, Any] = {}
        for mode, overrides in modes.items():
            result[mode] = ours([*overrides, *args.overrides], args.steps)
            print(f"round {index + 1} {mode}", json.dumps(result[mode]), flush=True)
        if args.trl:
            measured = trl(args.trl, args.steps)
            result["trl"] = {k: measured[k] for k in ("step_s_median", "trl_version", "transformers_version")}
            print(f"round {index + 1} trl", json.dumps(result["trl"]), flush=True)
        rounds.append(result)
    summary: dict[str, Any] = {"steps": args.steps, "rounds": rounds, "overrides": args.overrides}
    for mode in modes:
        summary[mode] = statistics.median(r[mode]["step_s_median"] for r in rounds)
    if args.trl:
        summary["trl"] = statistics.median(r["trl"]["step_s_median"] for r in rounds)
        # Per round, so that both sides of each ratio saw the same machine.
        ratios = {
            mode: [round(r["trl"]["step_s_median"] / r[mode]["step_s_median"], 2) for r in rounds]
            for mode in modes
        }
        summary["trl_over_ours"] = ratios
        summary["trl_over_ours_median"] = {mode: statistics.median(v) for mode, v in ratios.items()}
    summary["python"] = sys.version.split()[0]
    out = Path(args.out)
    if out.exists() and "placement" in (previous := json.loads(out.read_text())):
        summary["placement"] = previous["placement"]  # bench/placement.py's section
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}, indent=2))


if __name__ == "__main__":
    main()
