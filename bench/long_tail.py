"""End-to-end benchmark of long-tailed response lengths: the pipeline's trained tokens/s on
`recipes/bench-h200-long-tail.yaml` (L = 1 with partial rollouts, as shipped, and L = 0 without)
against the fixed-length `recipes/bench-h200-colocated.yaml`, the runs one after the other on the
same machine, each in a fresh interpreter.

Each run is ``python -m pipeline run --quiet RECIPE run.steps=STEPS+1 gates.checks=[]
run.dir=DIR/NAME OVERRIDES``, stopped (its process group killed) once STEPS steps are in its
metrics.jsonl, so that the final checkpoint save is not timed (nor its gates checked). Over steps
FIRST..STEPS (the first steps compile) each run gives:

- ``tokens_per_s``: the steps' trained tokens over their seconds (``throughput/tokens_per_s_per_gpu``
  times ``timing/step_s``, summed, over the summed seconds), and ``over_reference``, that over the
  first run's (the reference);
- ``training_tokens_per_s``: ``train/tokens`` over ``timing/train_s``, and its ratio to the
  reference's;
- the means of a step's parts (generation waited for, training, the decode loops' time and its
  prefill, check and wait shares, decode steps, their width and milliseconds, reprefilled tokens);
- the engine/trainer mismatch (``train/token_mult_prob_error``, ``train/gen_kl_error``: medians),
  ``rollout/max_lag`` and the training graphs compiled over those steps;
- the trained samples' lengths (the mean, and the means of the steps' p50 and p90), to set
  beside the distribution the recipe draws them from (`rollout.bench_lengths`): partial
  rollouts must leave no length bias.

It writes them as one section of ``--out`` (the file's other sections kept) and prints it.

    python -m bench.long_tail [--steps 12] [--first 3] [--limit-s 300] [--dir DIR]
        [--out bench/results-h200.json] [--section long_tail] [--run "NAME RECIPE key.path=value ..."]

Each ``--run`` (repeatable; shell-style quoting inside) replaces the default three: its name,
its recipe and its overrides; the first is the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LONG_TAIL = "recipes/bench-h200-long-tail.yaml"
RUNS = [
    "colocated recipes/bench-h200-colocated.yaml",
    f"L1 {LONG_TAIL}",
    f"L0 {LONG_TAIL} async_rl.max_lookahead_versions=0 rollout.partial=false rollout.max_rows=0",
]
RATIOS = {"over_reference": "tokens_per_s", "training_over_reference": "training_tokens_per_s"}
MEANS = {  # a step's parts: the summary's name, the metric
    "step_s": "timing/step_s",
    "wait_s": "timing/wait_s",
    "train_s": "timing/train_s",
    "loop_s": "timing/loop_s",
    "loop_prefill_s": "timing/loop_prefill_s",
    "loop_check_s": "timing/loop_check_s",
    "loop_wait_s": "timing/loop_wait_s",
    "decode_steps": "rollout/decode_steps",
    "decode_width": "rollout/decode_width",
    "decode_step_ms": "timing/decode_step_ms",
    "reprefilled_tokens": "rollout/reprefilled_tokens",
    "partial_samples": "rollout/partial_samples",
}


def summarize(steps: list[dict[str, Any]], first: int, last: int) -> dict[str, Any]:
    """The figures of steps ``first``..``last`` (metrics.jsonl's step lines; module docstring)."""
    chosen = [s for s in steps if first <= s["step"] <= last]
    if not chosen:
        raise ValueError(f"no step from {first} to {last} in the run's metrics")
    seconds = sum(s["timing/step_s"] for s in chosen)
    tokens = sum(s["throughput/tokens_per_s_per_gpu"] * s["timing/step_s"] for s in chosen)
    summary: dict[str, Any] = {
        "steps": [min(s["step"] for s in chosen), max(s["step"] for s in chosen)],
        "tokens_per_s": tokens / seconds,
        "training_tokens_per_s": sum(s["train/tokens"] for s in chosen)
        / sum(s["timing/train_s"] for s in chosen),
        "tokens_a_step": tokens / len(chosen),
    }
    for name, metric in MEANS.items():
        if all(metric in s for s in chosen):
            summary[name] = statistics.fmean(s[metric] for s in chosen)
    for name in ("token_mult_prob_error", "gen_kl_error"):
        summary[name] = statistics.median(s[f"train/{name}"] for s in chosen)
    summary["max_lag"] = max(s["rollout/max_lag"] for s in chosen)
    summary["compiled_graphs"] = sum(s.get("train/compiled_graphs", 0) for s in chosen)
    summary["trained_lengths"] = {
        "mean": sum(s["rollout/response_len"] * s["rollout/samples"] for s in chosen)
        / sum(s["rollout/samples"] for s in chosen),
        "p50_mean_of_steps": statistics.fmean(s["rollout/response_len_p50"] for s in chosen),
        "p90_mean_of_steps": statistics.fmean(s["rollout/response_len_p90"] for s in chosen),
        "max": max(s["rollout/response_len_max"] for s in chosen),
    }
    return summary


def step_lines(metrics: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's step lines (those with a step's time); none while it does not exist."""
    if not metrics.exists():
        return []
    # Whole lines only: the run may be writing the last one.
    whole = metrics.read_text().split("\n")[:-1]
    lines = [json.loads(line) for line in whole if line.strip()]
    return [line for line in lines if "timing/step_s" in line]


def one_run(run: str, steps: int, limit_s: float, root: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run ``run`` ("NAME RECIPE overrides...") until ``steps`` steps are logged (or ``limit_s``
    passed); its step lines and how it went."""
    name, recipe, *overrides = shlex.split(run)
    run_dir = root / name
    if run_dir.exists() and any(run_dir.iterdir()):  # its metrics would be read as this run's
        raise SystemExit(f"{run_dir} holds an earlier run: remove it, or give another --dir")
    command = [
        sys.executable, "-m", "pipeline", "run", "--quiet", recipe, f"run.steps={steps + 1}",
        "gates.checks=[]", f"run.dir={run_dir}", *overrides,
    ]  # fmt: skip
    log = root / f"{name}.log"
    began = time.monotonic()
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while process.poll() is None and len(step_lines(run_dir / "metrics.jsonl")) < steps:
                if time.monotonic() - began > limit_s:
                    break
                time.sleep(0.5)
        finally:  # the run's whole group (its compile workers too), however this ends
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
    lines = step_lines(run_dir / "metrics.jsonl")
    how = {
        "command": shlex.join(["python", *command[1:]]),
        "seconds": round(time.monotonic() - began, 1),
        "steps_logged": len(lines),
        "log": str(log),
    }
    return lines, how


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12, help="steps each run goes to")
    parser.add_argument("--first", type=int, default=3, help="the first step counted")
    parser.add_argument("--limit-s", type=float, default=300.0, help="the most seconds a run takes")
    parser.add_argument("--dir", type=Path, help="where the runs go (default: a new temporary directory)")
    parser.add_argument("--out", default="bench/results-h200.json")
    parser.add_argument("--section", default="long_tail", help="the section of --out written")
    parser.add_argument("--run", action="append", help='"NAME RECIPE key.path=value ..." (repeatable)')
    args = parser.parse_args()
    if args.first > args.steps:
        parser.error(f"--first {args.first} is past --steps {args.steps}")
    root = args.dir or Path(tempfile.mkdtemp(prefix="long_tail-"))
    root.mkdir(parents=True, exist_ok=True)
    runs: dict[str, Any] = {}
    for run in args.run or RUNS:
        name = shlex.split(run)[0]
        lines, how = one_run(run, args.steps, args.limit_s, root)
        if len(lines) < args.steps:
            raise SystemExit(f"{name}: {len(lines)} of {args.steps} steps logged; see {how['log']}")
        runs[name] = {**how, **summarize(lines, args.first, args.steps)}
        print(name, json.dumps(runs[name]), flush=True)
    reference = next(iter(runs.values()))
    for figures in runs.values():
        for ratio, of in RATIOS.items():
            figures[ratio] = figures[of] / reference[of]
    command = " ".join(["python -m bench.long_tail", shlex.join(sys.argv[1:])]).strip()
    section = {"command": command, "runs": runs}
    write_section(Path(args.out), args.section, section)
    print(json.dumps(section, indent=1))


def write_section(out: Path, name: str, section: dict[str, Any]) -> None:
    """``section`` as ``name`` of the JSON file ``out`` (made if missing), its other sections
    kept and its indentation too."""
    text = out.read_text() if out.exists() else ""
    lines = text.splitlines()
    indent = len(lines[1]) - len(lines[1].lstrip()) if len(lines) > 1 else 1
    results = json.loads(text) if text else {}
    results[name] = section
    out.write_text(json.dumps(results, indent=indent or 1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
