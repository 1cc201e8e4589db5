"""Benchmark: the generation of a step of the multi-turn GPU recipe, turns per second and where the
engine thread's time goes.

The recipe's rollout (`recipes/multi-turn-gpu.yaml`: 64 prompts x 16 episodes of the guessing game,
up to eight two-token turns each, colocated, L = 0) played by the real `Episodes` against the
real torch engine built as a run builds it, a step's 1024 episodes at once, with a stand-down and
a wake between two steps (a colocated train step's, training nothing): the engine's per-turn
work (admission, prefill, hand-over of finished rows, kept keys and values) is the figure. On the
CPU the model is the multi-turn CPU recipe's (2 layers, width 128), in float32; with
``--device cuda`` it is the GPU recipe's 25M model as shipped (bf16, CUDA graphs).

Each step's figures: wall seconds, turns (engine requests answered) per second, and the engine
thread's CPU seconds split by what ran (`hand_over`: finished rows taken off the device, their
keys and values kept and their requests answered; `admission`: the engine's source choosing
requests, kept keys and values taken; `prefill`: prompts prefilled or continued and their first
tokens drawn; `decode`: decode steps; `other`: the rest of the loop) and how many calls of
each part, with the event loop thread's CPU seconds beside them. The first step (start-up,
graph captures) is reported apart and left out of the medians.

    python -m bench.turns [--steps 4] [--device cpu|cuda] [--label NAME] [--out FILE] [key.path=value ...]
    python -m bench.turns --baseline DIR [--rounds 3] ...

Written under section `turns` of the results file (bench/results-cpu.json on the CPU,
bench/results-h200.json with ``--device cuda``), keyed by ``--label``, the file's other
sections and labels kept. ``--baseline DIR`` (a checkout of other code, e.g. `git worktree add
/tmp/before COMMIT`) runs this benchmark, each run in a fresh process, on DIR's code and on this
checkout's in turn, ``--rounds`` times, for a before/after figure on the same machine at the
same time: each run's summary under ``before`` and ``after``, and the ratios of their medians.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

RECIPE = "recipes/multi-turn-gpu.yaml"
CPU_MODEL = [
    "model.device=cpu",
    "model.dtype=float32",
    "model.residual=float32",
    "model.config.hidden_size=128",
    "model.config.intermediate_size=256",
    "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4",
    "model.config.num_key_value_heads=2",
    "model.threads=2",
]
PARTS = ("hand_over", "admission", "prefill", "decode")


class Split:
    """CPU seconds of the engine thread inside each instrumented call (outermost only: a part
    called inside another counts as that other)."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self._inside = threading.local()

    def wrap(self, owner: Any, name: str, part: str) -> None:
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._inside, "part", None) is not None:
                return inner(*args, **kwargs)
            self._inside.part = part
            start = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[part] += time.thread_time() - start
                self.calls[part] += 1
                self._inside.part = None

        setattr(owner, name, timed)

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        out = {part: self.seconds[part] for part in PARTS}, {part: self.calls[part] for part in PARTS}
        self.seconds.clear()
        self.calls.clear()
        return out


def instrument(engine: Any, split: Split) -> None:
    sampler = engine.sampler
    split.wrap(sampler, "_hand_over", "hand_over")
    split.wrap(engine, "_admit", "admission")
    split.wrap(sampler, "_first_tokens", "prefill")
    split.wrap(sampler.steps, "run", "decode")


@contextmanager
def quiet_logs() -> Iterator[None]:
    import logging

    level = logging.root.level
    logging.root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logging.root.setLevel(level)


async def play(overrides: list[str], steps: int, report: Callable[[dict[str, Any]], None]) -> None:
    import anyio

    from backends.torch.build import build_backend
    from pipeline import load_recipe
    from pipeline.clock import DeadlineClock
    from pipeline.environments import resolve
    from pipeline.gate import EngineGate
    from pipeline.shell.backend_input import backend_input
    from stages.episodes import Episodes
    from stages.prompts import build_prompts

    recipe = load_recipe(RECIPE, overrides)
    prompts = build_prompts(recipe.prompts, recipe.run.seed)
    engine, _ = build_backend(
        backend_input(recipe), vocab_size=prompts.tokenizer.vocab_size, stop_ids=prompts.tokenizer.stop_ids
    )
    split = Split()
    instrument(engine, split)
    clock = DeadlineClock()
    gate = EngineGate(engine, clock)
    rollout = recipe.rollout
    episodes = Episodes(
        rollout,
        factory=resolve(rollout.environment, rollout.environment_args),
        tokenizer=prompts.tokenizer,
        gate=gate,
        clock=clock,
    )
    per_step = recipe.prompts.prompts_per_step

    async def train() -> None:  # a colocated step's stand-down and wake, training nothing
        return None

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(clock.run)
            for step in range(steps):
                batch = [next(prompts.train) for _ in range(per_step)]
                counts: Counter[str] = Counter()
                turns: list[int] = []
                wins: list[float] = []
                engine_cpu = await engine.compute.run(time.thread_time)
                loop_cpu = time.thread_time()
                loops = engine.calls
                split.take()
                start = time.perf_counter()

                async def one(prompt: Any, counts: Counter[str], turns: list[int], wins: list[float]) -> None:
                    episode = await episodes.run(prompt, counts=counts)
                    turns.append(episode.stats.turns)
                    wins.append(episode.info.get("success", 0.0))

                async with anyio.create_task_group() as group:
                    for prompt in batch:
                        for _ in range(rollout.samples_per_prompt):
                            group.start_soon(one, prompt, counts, turns, wins)
                wall_s = time.perf_counter() - start
                loop_cpu = time.thread_time() - loop_cpu
                engine_cpu = await engine.compute.run(time.thread_time) - engine_cpu
                parts, calls = split.take()
                parts["other"] = max(0.0, engine_cpu - sum(parts.values()))
                report(
                    {
                        "step": step,
                        "wall_s": wall_s,
                        "episodes": len(turns),
                        "turns": sum(turns),
                        "turns_per_s": sum(turns) / wall_s,
                        "loops": engine.calls - loops,
                        "engine_cpu_s": engine_cpu,
                        "engine_split_s": parts,
                        "engine_calls": calls,
                        "event_loop_cpu_s": loop_cpu,
                        "success": statistics.mean(wins),
                    }
                )
                await gate.step(train)
            tg.cancel_scope.cancel()
    finally:
        engine.close()


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    timed = records[1:] or records
    return {
        "wall_s_median": statistics.median(r["wall_s"] for r in timed),
        "turns_per_s_median": statistics.median(r["turns_per_s"] for r in timed),
        "engine_cpu_s_median": statistics.median(r["engine_cpu_s"] for r in timed),
        "engine_split_s_median": {
            part: statistics.median(r["engine_split_s"][part] for r in timed) for part in (*PARTS, "other")
        },
        "event_loop_cpu_s_median": statistics.median(r["event_loop_cpu_s"] for r in timed),
        "cpu_s_per_turn_median": statistics.median(
            (r["engine_cpu_s"] + r["event_loop_cpu_s"]) / r["turns"] for r in timed
        ),
        "first_step": records[0],
        "steps": timed,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """This checkout's figures, played in this process."""
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")  # as the pipeline sets it (backends/torch/runtime.py)
    from backends.torch.runtime import load

    load()
    import anyio
    import torch

    overrides = (CPU_MODEL if args.device == "cpu" else []) + list(args.overrides)
    records: list[dict[str, Any]] = []

    def report(record: dict[str, Any]) -> None:
        print(json.dumps(record), flush=True)
        records.append(record)

    with quiet_logs():
        anyio.run(play, overrides, args.steps, report)
    return {
        "recipe": RECIPE,
        "overrides": overrides,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else f"cpu x{os.cpu_count()}",
        "torch_threads": torch.get_num_threads(),
        "load": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%d %H:%M"),
        **summary(records),
    }


def in_process(directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The figures of the code in ``directory``, played by this file in a fresh process there."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        command = [
            sys.executable, str(Path(__file__).resolve()), "--steps", str(args.steps),
            "--device", args.device, "--label", "run", "--out", str(out), *args.overrides,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(directory)}
        done = subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"{' '.join(command)} in {directory} exited {done.returncode}:\n{done.stderr}")
        figures: dict[str, Any] = json.loads(out.read_text())["turns"]["run"]
    figures.pop("command")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4, help="steps played (the first is reported apart)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--label", default="latest", help="the key its figures go under")
    parser.add_argument("--out", default=None)
    parser.add_argument("--baseline", type=Path, default=None, help="a checkout of the code to compare with")
    parser.add_argument("--rounds", type=int, default=3, help="with --baseline: runs of each")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, after the device's")
    args = parser.parse_args()
    command = " ".join(["python -m bench.turns", *sys.argv[1:]])
    if args.baseline is None:
        figures = {"command": command, **measure(args)}
    else:
        here = Path.cwd()
        runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
        for index in range(args.rounds):
            order = [("before", args.baseline), ("after", here)]
            for name, directory in order if index % 2 == 0 else order[::-1]:
                runs[name].append(in_process(directory, args))
                print(name, json.dumps({k: v for k, v in runs[name][-1].items() if k.endswith("median")}))
        keys = ("wall_s_median", "engine_cpu_s_median", "event_loop_cpu_s_median", "cpu_s_per_turn_median",
                "turns_per_s_median")  # fmt: skip
        medians = {
            name: {k: statistics.median(r[k] for r in done) for k in keys} for name, done in runs.items()
        }
        figures = {
            "command": command,
            "medians": medians,
            "after_over_before": {k: medians["after"][k] / medians["before"][k] for k in medians["after"]},
            **runs,
        }
    out = Path(args.out or ("bench/results-cpu.json" if args.device == "cpu" else "bench/results-h200.json"))
    results = json.loads(out.read_text()) if out.exists() else {}
    results.setdefault("turns", {})[args.label] = figures
    out.write_text(json.dumps(results, indent=2) + "\n")
    shown = {k: v for k, v in figures.items() if k not in ("steps", "first_step", "before", "after")}
    print(json.dumps(shown))


if __name__ == "__main__":
    main()
