"""CPU benchmark: the controller's overhead per step on Ray beside in-process, in one run.

Runs the quickstart (colocated, L = 1, no evaluation) in rounds, each round once in-process
(`placement.backend: local`) and once on Ray (`ray`: trainer and engine in one actor, the
controller awaiting it), one after the other so that both see the same machine; steps 1-5 are
warm-up and excluded. The Ray runtime (2 CPUs, no dashboard) is started once, before the first
round. Writes each round's medians and the overhead (Ray's median step over in-process's,
minus 1) to the `placement` section of bench/results-cpu.json.

    python -m bench.placement [--steps 60] [--rounds 3] [key.path=value ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
from pathlib import Path
from typing import Any

from bench.cpu import ours

RECIPE = "recipes/quickstart.yaml"
MODES = {"local": ["placement.backend=local"], "ray": ["placement.backend=ray"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench/results-cpu.json")
    parser.add_argument("overrides", nargs="*", help="recipe overrides applied to both")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_worker_niceness", "0")  # as a runtime the pipeline starts has
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    base = ["async_rl.max_lookahead_versions=1", "colocated=true", *args.overrides]  # ours() drops the gates
    rounds: list[dict[str, Any]] = []
    for index in range(args.rounds):
        result = {mode: ours([*base, *extra], args.steps, recipe=RECIPE) for mode, extra in MODES.items()}
        result["overhead"] = result["ray"]["step_s_median"] / result["local"]["step_s_median"] - 1
        print(f"round {index + 1}", json.dumps(result), flush=True)
        rounds.append(result)
    ray.shutdown()
    summary = {
        "recipe": RECIPE,
        "steps": args.steps,
        "overrides": base,
        "rounds": rounds,
        "overhead_median": statistics.median(r["overhead"] for r in rounds),
        "step_s_median": {
            mode: statistics.median(r[mode]["step_s_median"] for r in rounds) for mode in MODES
        },
    }
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    results["placement"] = summary
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}, indent=2))


if __name__ == "__main__":
    main()
