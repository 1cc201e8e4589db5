"""CPU benchmark: the controller's overhead per step on Ray beside in-process, in one run.

Runs the quickstart (colocated, L = 1, no evaluation) in many short rounds, each round once
in-process (`placement.backend: local`) and once on Ray (`ray`: trainer and engine in one actor,
the controller awaiting it), one right after the other and in turn first, so that both see the
same machine; steps 1-5 of each are warm-up and excluded. The Ray runtime (2 CPUs, no
dashboard) is started once, before the first round, and timed apart: a user pays it once per
run. A round's overhead is Ray's median step over in-process's, minus 1; on a shared machine
whose speed drifts over minutes the median of many rounds' overheads is the figure, and their
spread and the load average at each round's start are written beside it (section
`placement` of bench/results-cpu.json; the file's other sections are kept).

    python -m bench.placement [--steps 30] [--rounds 10] [key.path=value ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

from bench.cpu import ours

RECIPE = "recipes/quickstart.yaml"
MODES = {"local": ["placement.backend=local"], "ray": ["placement.backend=ray"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default="bench/results-cpu.json")
    parser.add_argument("overrides", nargs="*", help="recipe overrides applied to both")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_worker_niceness", "0")  # as a runtime the pipeline starts has
    import ray

    start = time.perf_counter()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    ray_init_s = time.perf_counter() - start
    base = ["async_rl.max_lookahead_versions=1", "colocated=true", *args.overrides]  # ours() drops the gates
    rounds: list[dict[str, Any]] = []
    for index in range(args.rounds):
        order = list(MODES) if index % 2 == 0 else list(reversed(MODES))
        result: dict[str, Any] = {"load": os.getloadavg()[0], "first": order[0]}
        for mode in order:
            result[mode] = ours([*base, *MODES[mode]], args.steps, recipe=RECIPE)
        result["overhead"] = result["ray"]["step_s_median"] / result["local"]["step_s_median"] - 1
        print(f"round {index + 1}", json.dumps(result), flush=True)
        rounds.append(result)
    ray.shutdown()
    overheads = [r["overhead"] for r in rounds]
    summary = {
        "recipe": RECIPE,
        "steps": args.steps,
        "overrides": base,
        "ray_init_s": ray_init_s,
        "rounds": rounds,
        "overhead_median": statistics.median(overheads),
        "overhead_range": [min(overheads), max(overheads)],
        "load_range": [min(r["load"] for r in rounds), max(r["load"] for r in rounds)],
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
