"""CPU benchmark: how long the pipeline, embedded, ever holds its host's event loop.

A host process (a fresh interpreter per run) beats a heartbeat every 5 ms on its asyncio loop
and awaits `pipeline.run` on a short quickstart (evaluations, checkpoints and the report's PNG
included), from `load_recipe` to the end; every gap between beats past the 5 ms asked for is
a stall, the pipeline's or the machine's. Each round runs two hosts in turn: one that imported
torch itself before the run (its import is then not the pipeline's; with `GOMP_SPINCOUNT=1000`,
as the pipeline's warning tells such a host) and one that did not. Each run is a fresh clone's
first: the checkout's own modules have no bytecode cached (removed before the run), and the
host's interpreter may write it (`PYTHONDONTWRITEBYTECODE` unset), as a user's does.

A stall is split in two where Linux says how the loop's thread spent it
(`/proc/thread-self/schedstat`): `cpu_wait_ms`, the time it was ready to run and waited for a
core (the machine's: other processes had the cores), and `held_ms`, the rest (the time it ran,
or waited on the interpreter lock that a worker thread of the pipeline held: the pipeline's).
The host asks for a higher priority where it may, so that on a shared machine less of a stall
is the machine's: a session of its own whose autogroup (Linux's scheduler shares the cores
between sessions, whatever a process's nice value) it gives nice -10, and nice -10 itself (as
root); whether it got them is written beside its figures. Written: the worst stalls of each run
(by `held_ms`) with the seconds since the run began at which they ended, and, over all runs,
the worst and the count above 50 ms, of the held part and of the whole gap (section `host_loop`
of bench/results-cpu.json; the file's other sections are kept).

    python -m bench.host_loop [--rounds 3] [--steps 8] [--baseline DIR] [--cold] [--section NAME]
        [key.path=value ...]

`--cold` empties the kernel's page cache before each run (root on Linux: `sync` and
/proc/sys/vm/drop_caches), as after a boot or after other work pushed the libraries out: a
library opened under the interpreter lock then holds it while its pages come from disk.
`--section` names the results' section (default `host_loop`).

`--baseline DIR` (a checkout of other code, e.g. `git worktree add /tmp/before COMMIT`) runs the
same hosts from DIR too, in turn with this checkout's in each round, for a before/after figure
on the same machine at the same time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

RECIPE = "recipes/quickstart.yaml"
GOAL_MS = 50.0

HOST = """
import asyncio, json, logging, os, sys, time
if sys.argv[2] == "torch-first":
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")  # what the pipeline tells such a host to do
    import torch
import pipeline

try:
    os.nice(-10)
    with open("/proc/self/autogroup", "w") as group:  # the bench started this host's own session
        group.write("-10")
    niced = True
except OSError:
    niced = False

def cpu_wait():  # seconds this thread has spent ready to run, waiting for a core (0: not Linux)
    try:
        with open("/proc/thread-self/schedstat") as stat:
            return int(stat.read().split()[1]) / 1e9
    except OSError:
        return 0.0

# The pipeline's info lines (what it is doing: loading torch, building the model, ...) and when
# they came, so that each stall can be put in its phase.
class Phases(logging.Handler):

    def __init__(self):
        super().__init__(logging.INFO)
        self.seen = []

    def emit(self, record):
        if record.name.partition(".")[0] in ("pipeline", "stages", "backends"):
            self.seen.append((time.perf_counter() - start, record.getMessage()))

phases = Phases()
logging.getLogger().addHandler(phases)
logging.getLogger().setLevel(logging.INFO)
start = time.perf_counter()

def phase_at(at):
    before = [message for seen, message in phases.seen if seen <= at]
    return before[-1] if before else "before the first line"

async def main(run_dir, overrides):
    global start
    stalls, done = [], False

    async def heartbeat():
        last, waited = time.perf_counter(), cpu_wait()
        while not done:
            await asyncio.sleep(0.005)
            now, waited_now = time.perf_counter(), cpu_wait()
            gap = now - last - 0.005
            stalls.append((gap - (waited_now - waited), gap, now - start))
            last, waited = now, waited_now

    beat = asyncio.create_task(heartbeat())
    await asyncio.sleep(0.05)
    start = time.perf_counter()
    recipe = await asyncio.to_thread(pipeline.load_recipe, sys.argv[3], [f"run.dir={run_dir}", *overrides])
    summary = await pipeline.run(recipe)
    done = True
    await beat
    worst = sorted(stalls, reverse=True)[:5]
    print(json.dumps({
        "steps": summary.steps_done, "niced": niced, "run_s": time.perf_counter() - start,
        "worst": [{"held_ms": round(held * 1000, 1), "cpu_wait_ms": round((gap - held) * 1000, 1),
                   "at_s": round(at, 2), "after": phase_at(at - gap)} for held, gap, at in worst],
        "worst_gap_ms": round(max(gap for _, gap, _ in stalls) * 1000, 1),
        "phases": [[round(at, 2), message[:60]] for at, message in phases.seen if "gate" not in message],
        "over_50_ms": sum(held > 0.05 for held, _, _ in stalls),
        "gaps_over_50_ms": sum(gap > 0.05 for _, gap, _ in stalls),
    }))

asyncio.run(main(sys.argv[1], json.loads(sys.argv[4])))
"""

HOSTS = ("torch-first", "pipeline-only")
PACKAGES = ("pipeline", "stages", "backends")


def one_run(host: str, overrides: list[str], checkout: Path, cold: bool) -> dict[str, Any]:
    # A fresh clone's first run, as a user's interpreter runs it: no bytecode cached for the
    # checkout's own modules, and writing it allowed.
    for cache in (p for package in PACKAGES for p in (checkout / package).rglob("__pycache__")):
        shutil.rmtree(cache)
    if cold:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    env = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-c", HOST, str(Path(tmp) / "run"), host, RECIPE, json.dumps(overrides)]
        load = os.getloadavg()[0]
        # `-c` puts the working directory first on the path: the checkout's pipeline is the one run.
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            check=False,
            cwd=checkout,
            env=env,
            start_new_session=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"the {host} host exited {done.returncode}:\n{done.stderr}")
    return {"load": load, **json.loads(done.stdout.splitlines()[-1])}


def _commit(path: Path) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=path, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=path, capture_output=True, text=True
    )
    return done.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--baseline", type=Path, help="another checkout, run in turn with this one")
    parser.add_argument("--cold", action="store_true", help="empty the page cache before each run (root)")
    parser.add_argument("--section", default="host_loop", help="the section of --out written")
    parser.add_argument("--out", default="bench/results-cpu.json")
    parser.add_argument("overrides", nargs="*", help="recipe overrides applied to every run")
    args = parser.parse_args()
    if args.cold and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        parser.error("--cold empties the page cache through /proc/sys/vm/drop_caches: run as root on Linux")
    overrides = [
        f"run.steps={args.steps}", "eval.every_steps=4", "eval.num_prompts=64", "checkpoint.every_steps=4",
        "run.plot=true", *args.overrides,
    ]  # fmt: skip
    here = Path(__file__).resolve().parents[1]
    checkouts = {"this": here, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    hosts = [f"{host}@{name}" for name in checkouts for host in HOSTS]
    rounds = []
    for index in range(args.rounds):
        order = hosts if index % 2 == 0 else hosts[::-1]
        result = {}
        for key in order:
            host, _, name = key.partition("@")
            result[key] = one_run(host, overrides, checkouts[name], args.cold)
        print(f"round {index + 1}", json.dumps(result), flush=True)
        rounds.append(result)
    runs = [r[key] for r in rounds for key in hosts]
    summary = {
        "recipe": RECIPE,
        "overrides": overrides,
        "command": " ".join(["python -m bench.host_loop", *sys.argv[1:]]),
        "checkouts": {name: _commit(path) for name, path in checkouts.items()},
        "goal_ms": GOAL_MS,
        "rounds": rounds,
        "worst_ms": {key: max(r[key]["worst"][0]["held_ms"] for r in rounds) for key in hosts},
        "median_worst_ms": {
            key: statistics.median(r[key]["worst"][0]["held_ms"] for r in rounds) for key in hosts
        },
        "runs_over_goal": {key: sum(r[key]["over_50_ms"] > 0 for r in rounds) for key in hosts},
        "worst_gap_ms": {key: max(r[key]["worst_gap_ms"] for r in rounds) for key in hosts},
        "runs_with_gaps_over_goal": {
            key: sum(r[key]["gaps_over_50_ms"] > 0 for r in rounds) for key in hosts
        },
        "runs": args.rounds,
        "cold": args.cold,
        "load_range": [min(r["load"] for r in runs), max(r["load"] for r in runs)],
    }
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    results[args.section] = summary
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}, indent=2))


if __name__ == "__main__":
    main()
