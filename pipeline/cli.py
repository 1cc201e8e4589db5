"""The command line: `python -m pipeline run|validate RECIPE [key.path=value ...]`, and
`inspect CHECKPOINT`, `export CHECKPOINT OUT_DIR`, `generate MODEL --prompt TEXT`,
`plot RUN_DIR [RUN_DIR ...]`, `timeline RUN_DIR`, `check RUN_DIR [--recipe RECIPE]`.

Exit codes: 0 success or clean stop, 1 a run error the user can act on, 2 a bad recipe or
command line, 3 the run finished (or stopped cleanly) but a metric gate of its recipe failed
(`gates.fail: false` keeps 0; `check` exits 3 the same way), 128+N a second signal N (exits at
once).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

import pipeline
from pipeline import logs
from pipeline.console import Console, ConsoleHandler
from pipeline.errors import PipelineError, RecipeError, StageFailed
from pipeline.runner import first_error

GATES_FAILED = 3  # the exit code of a run (or `check`) whose metric gates failed


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline", description="Asynchronous GRPO trainer")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("run", "train with a recipe"),
        ("validate", "check a recipe without running it"),
    ):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("recipe", help="recipe YAML file")
        command.add_argument("overrides", nargs="*", help="dotted overrides, e.g. run.steps=20")
        command.add_argument("--quiet", action="store_true", help="no progress display")
    inspect = commands.add_parser("inspect", help="show what a checkpoint holds")
    inspect.add_argument("checkpoint", help="a checkpoint directory (run.dir/checkpoints/step-NNNNNN)")
    inspect.add_argument("--recipe", help="compare the checkpoint's recipe with this one")
    export = commands.add_parser("export", help="write a checkpoint as a Hugging Face model directory")
    export.add_argument("checkpoint", help="a checkpoint directory (run.dir/checkpoints/step-NNNNNN)")
    export.add_argument("out_dir", help="the directory to write (config.json, model.safetensors, tokenizer)")
    generate = commands.add_parser("generate", help="complete one prompt with a checkpoint or model")
    generate.add_argument("model", help="a checkpoint directory or a Hugging Face model directory")
    generate.add_argument("--prompt", required=True, help="the prompt text")
    generate.add_argument("--max-new-tokens", type=_positive_int, default=128)
    generate.add_argument("--temperature", type=_non_negative_float, default=0.0, help="0: greedy")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--chat", action="store_true", help="render the prompt through the chat template")
    generate.add_argument("--system", help="a system turn before the prompt (with --chat)")
    generate.add_argument("--device", default="cpu")
    generate.add_argument("--json", action="store_true", help="print token ids and logprobs as JSON")
    plot = commands.add_parser("plot", help="a PNG report of one run, or several compared")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    plot.add_argument(
        "--out", help="the PNG to write (default RUN_DIR/report.png, or report.png for several)"
    )
    timeline = commands.add_parser("timeline", help="a PNG of a window of a run's trace.json")
    timeline.add_argument("run_dir", metavar="RUN_DIR")
    timeline.add_argument("--steps", help="FIRST:LAST train steps to show (default: the last three)")
    timeline.add_argument("--out", help="the PNG to write (default RUN_DIR/timeline.png)")
    check = commands.add_parser("check", help="evaluate a recipe's metric gates on a run directory")
    check.add_argument("run_dir", metavar="RUN_DIR")
    check.add_argument("--recipe", help="the recipe whose gates to evaluate (default RUN_DIR/recipe.yaml)")
    for sub in commands.choices.values():
        sub.add_argument(
            "--log-level",
            default="INFO",
            type=str.upper,
            choices=["DEBUG", "INFO", "WARNING", "ERROR"],
            help="the least severe log records shown (default INFO)",
        )
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logs.setup(args.log_level)
    try:
        if args.command == "plot":
            return _plot(args.run_dirs, args.out)
        if args.command == "timeline":
            return _timeline(args.run_dir, args.steps, args.out)
        if args.command == "inspect":
            return _inspect(args.checkpoint, args.recipe)
        if args.command == "export":
            return _export(args.checkpoint, args.out_dir)
        if args.command == "generate":
            return _generate(args)
        if args.command == "check":
            return _check(args.run_dir, args.recipe)
        recipe = pipeline.load_recipe(args.recipe, args.overrides)
        if args.command == "validate":
            print(f"{args.recipe}: ok")
            return 0
        console = None
        if not args.quiet and recipe.run.progress:
            console = Console(recipe.run.steps, log_every=recipe.run.log_every_steps)
            if console.live:
                logs.setup(args.log_level, ConsoleHandler(console))
        try:
            summary = anyio.run(_run, recipe, console, backend_options={"use_uvloop": True})
        finally:
            if console is not None and console.live:
                logs.setup(args.log_level)  # the status line is gone: plain log lines again
    except PipelineError as error:
        if isinstance(error, StageFailed):  # a bug, not a user mistake: keep its traceback
            traceback.print_exception(error.error)
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    state = "stopped" if summary.stopped else "finished"
    print(
        f"{state} after {summary.steps_done} steps (policy version {summary.policy_version}); "
        f"run dir {summary.run_dir}"
    )
    if summary.verdict.results:
        print(f"{summary.verdict.summary()} (see {summary.run_dir}/gates.json)")
    return GATES_FAILED if not summary.passed and recipe.gates.fail else 0


def _check(run_dir: str, recipe_path: str | None) -> int:
    from pipeline.metrics import STEPS_FILE
    from stages.gates import describe, evaluate_gates

    directory = Path(run_dir)
    if not (directory / STEPS_FILE).is_file():
        raise RecipeError(f"{directory}: no {STEPS_FILE} here: not a run directory")
    source = recipe_path or directory / "recipe.yaml"
    recipe = pipeline.load_recipe(source)
    if not recipe.gates.checks:
        raise RecipeError(f"{source}: gates.checks: the recipe has no gates (give one with --recipe)")
    verdict = evaluate_gates(directory, recipe.gates, steps=recipe.run.steps)
    for result in verdict.results:
        print(describe(result))
    print(verdict.summary())
    return 0 if verdict.passed else GATES_FAILED


def _inspect(checkpoint: str, recipe_path: str | None) -> int:
    import msgspec

    from stages.checkpoint import describe

    against = msgspec.to_builtins(pipeline.load_recipe(recipe_path)) if recipe_path else None
    print(describe(Path(checkpoint), against))
    return 0


def _export(checkpoint: str, out_dir: str) -> int:
    from stages.model_files import export

    print(f"exported {checkpoint} to {export(checkpoint, out_dir)}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    import msgspec

    from stages.generate import generate
    from stages.model_files import open_model

    result = generate(
        open_model(args.model, device=args.device),
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        chat=args.chat,
        system=args.system,
        seed=args.seed,
    )
    print(msgspec.json.encode(result).decode() if args.json else result.text)
    return 0


def _plot(run_dirs: list[str], out: str | None) -> int:
    from pipeline.plot import write_report

    default = Path(run_dirs[0]) / "report.png" if len(run_dirs) == 1 else Path("report.png")
    print(f"wrote {write_report([Path(d) for d in run_dirs], Path(out) if out else default)}")
    return 0


def _timeline(run_dir: str, steps: str | None, out: str | None) -> int:
    from pipeline.timeline import write_timeline

    first = last = None
    if steps:
        try:
            first, last = (int(part) for part in steps.split(":"))
        except ValueError:
            raise RecipeError(f"--steps: expected FIRST:LAST (e.g. 10:12), got {steps!r}") from None
    path = write_timeline(
        Path(run_dir), Path(out) if out else Path(run_dir) / "timeline.png", first=first, last=last
    )
    print(f"wrote {path}")
    return 0


async def _run(recipe: Any, console: Console | None) -> Any:
    stop = pipeline.StopRequest()
    result: list[Any] = []
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_signals, stop)

            async def body() -> None:
                result.append(await pipeline.run(recipe, stop=stop, console=console))
                tg.cancel_scope.cancel()

            tg.start_soon(body)
    except BaseExceptionGroup as group:
        raise first_error(group) from None
    return result[0]


async def _watch_signals(stop: pipeline.StopRequest) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if stop.requested.is_set():
                print(f"second {name}: exiting now", file=sys.stderr, flush=True)
                os._exit(128 + signum)
            stop.request(f"{name} received")
