"""CPU benchmark: the quickstart's seconds per step for several `model.threads` settings, alone
and beside busy processes.

Each round runs the quickstart (no evaluation, no plot) once per setting, in turn and in an
order that alternates between rounds, each in a fresh process with a run directory of its own;
then the same beside `--busy` CPU-bound processes (`python -c "while True: pass"`) that this
benchmark starts before and kills after. A run's figure is its median `timing/step_s` after
the first two steps (start-up excluded), with its process's wall time beside it. On a shared
machine only the ratios within a round mean much; the load average at each run's start is
written beside it (section `threads` of bench/results-cpu.json; the file's other sections are
kept).

    python -m bench.threads [--steps 20] [--rounds 3] [--busy 2] [--settings 1,2] [key.path=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeline.metrics import read

RECIPE = "recipes/quickstart.yaml"
WARMUP = 2


def one_run(threads: str, steps: int, overrides: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        command = [
            sys.executable, "-m", "pipeline", "run", RECIPE, f"run.dir={run_dir}", f"run.steps={steps}",
            "eval.every_steps=0", "run.plot=false", f"model.threads={threads}", *overrides, "--quiet",
        ]  # fmt: skip
        load = os.getloadavg()[0]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        wall_s = time.perf_counter() - start
        if done.returncode not in (0, 3):  # 3: a gate failed, which a short run may
            raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr}")
        step_s = [r["timing/step_s"] for r in read(run_dir / "metrics.jsonl")[WARMUP:]]
    return {"load": load, "step_s_median": statistics.median(step_s), "wall_s": wall_s}


def rounds(settings: list[str], *, busy: int, count: int, steps: int, overrides: list[str]) -> list[dict]:
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        out = []
        for index in range(count):
            order = settings if index % 2 == 0 else settings[::-1]
            result: dict[str, Any] = {"first": order[0]}
            for threads in order:
                result[threads] = one_run(threads, steps, overrides)
            print(f"busy {busy} round {index + 1}", json.dumps(result), flush=True)
            out.append(result)
        return out
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy", type=int, default=2)
    parser.add_argument("--settings", default="1,2", help="model.threads values, comma-separated")
    parser.add_argument("--out", default="bench/results-cpu.json")
    parser.add_argument("overrides", nargs="*", help="recipe overrides applied to every run")
    args = parser.parse_args()
    settings = args.settings.split(",")
    summary: dict[str, Any] = {
        "recipe": RECIPE,
        "steps": args.steps,
        "overrides": ["eval.every_steps=0", "run.plot=false", *args.overrides],
        "cpus": os.cpu_count(),
        "command": " ".join(["python -m bench.threads", *sys.argv[1:]]),
    }
    for busy in (0, args.busy):
        done = rounds(settings, busy=busy, count=args.rounds, steps=args.steps, overrides=args.overrides)
        summary[f"busy={busy}"] = {
            "rounds": done,
            "step_s_median": {t: statistics.median(r[t]["step_s_median"] for r in done) for t in settings},
            "wall_s_median": {t: statistics.median(r[t]["wall_s"] for r in done) for t in settings},
            "load_range": [min(r[t]["load"] for r in done for t in settings),
                           max(r[t]["load"] for r in done for t in settings)],
        }  # fmt: skip
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    results["threads"] = summary
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if not k.startswith("busy")}, indent=2))
    for busy in (0, args.busy):
        print(busy, json.dumps({k: v for k, v in summary[f"busy={busy}"].items() if k != "rounds"}))


if __name__ == "__main__":
    main()
