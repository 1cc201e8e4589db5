"""The command line: `python -m pipeline COMMAND ...`; the commands are the table `COMMANDS`
(their grammar is `pipeline.shell.arguments`), each handled by one function here.

Exit codes: 0 success or clean stop, 1 a run error the user can act on, 2 a bad recipe or
command line, 3 the run finished (or stopped cleanly) but a metric gate of its recipe failed
(`gates.fail: false` keeps 0; `check` exits 3 the same way), 128+N a second signal N (exits at
once).
"""

from __future__ import annotations

import argparse
import logging
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
from pipeline.children import kill_descendants
from pipeline.contracts.errors import PipelineError, RecipeError, StageFailed
from pipeline.runner import first_error
from pipeline.shell.arguments import Command, parse
from pipeline.shell.console import Console, ConsoleHandler

GATES_FAILED = 3  # the exit code of a run (or `check`) whose metric gates failed


def _recipe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", metavar="RECIPE", help="recipe YAML file")
    parser.add_argument(
        "overrides",
        nargs="*",
        default=[],  # without a default argparse counts an empty `*` positional as missing
        metavar="key.path=value",
        help="dotted overrides, e.g. run.steps=20",
    )


def _run_arguments(parser: argparse.ArgumentParser) -> None:
    _recipe_arguments(parser)
    parser.add_argument("--quiet", action="store_true", help="no progress display (and no wandb output)")


def _inspect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint directory (run.dir/checkpoints/step-NNNNNN)")
    parser.add_argument("--recipe", help="compare the checkpoint's recipe with this one")


def _export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint directory (run.dir/checkpoints/step-NNNNNN)")
    parser.add_argument(
        "out_dir", help="a new or empty directory to write (config.json, model.safetensors, tokenizer)"
    )


def _generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a checkpoint directory or a Hugging Face model directory")
    parser.add_argument(
        "--prompt", required=True, help="the prompt text, as the run's prompts were written (e.g. 12349=)"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        help="the most tokens to generate (default: as many as the run generated, else 128; "
        "at most what fits a learned position table)",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat", action="store_true", help="render the prompt through the chat template")
    parser.add_argument("--system", help="a system turn before the prompt (with --chat)")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N")
    parser.add_argument("--json", action="store_true", help="print token ids and logprobs as JSON")


def _plot_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument(
        "--out", help="the PNG to write (default RUN_DIR/report.png; required for several runs)"
    )


def _check_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("--recipe", help="the recipe whose gates to evaluate (default RUN_DIR/recipe.yaml)")


def _timeline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("--steps", help="FIRST:LAST train steps to show (default: the last three)")
    parser.add_argument("--out", help="the PNG to write (default RUN_DIR/timeline.png)")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(COMMANDS, argv)
    logs.setup(args.log_level)
    try:
        return args.handler(args)
    except PipelineError as error:
        if isinstance(error, StageFailed):  # a bug, not a user mistake: keep its traceback
            traceback.print_exception(error.error)
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code


def _validate(args: argparse.Namespace) -> int:
    from pipeline.shell.preflight import preflight

    preflight(pipeline.load_recipe(args.recipe, args.overrides))
    print(f"{args.recipe}: ok")
    return 0


def _run(args: argparse.Namespace) -> int:
    recipe = pipeline.load_recipe(args.recipe, args.overrides)
    if args.quiet:
        os.environ["WANDB_SILENT"] = "true"  # wandb prints its own banner and summary otherwise
    console = None
    narration = logging.getLogger(logs.NARRATION)
    told = None
    if not args.quiet and recipe.run.progress:
        console = Console(recipe.run.steps, log_every=recipe.run.log_every_steps)
        if console.live:
            logs.setup(args.log_level, ConsoleHandler(console))
        else:  # what start-up is doing goes with the console's lines, not to stderr
            told = ConsoleHandler(console)
            narration.addHandler(told)
    try:
        summary = anyio.run(_run_task, recipe, console, backend_options={"use_uvloop": True})
    finally:
        if told is not None:
            narration.removeHandler(told)
        if console is not None and console.live:
            logs.setup(args.log_level)  # the status line is gone: plain log lines again
    state = "stopped" if summary.stopped else "finished"
    print(
        f"{state} after {summary.steps_done} steps (policy version {summary.policy_version}); "
        f"run dir {summary.run_dir}"
    )
    if summary.verdict.results:
        print(f"{summary.verdict.summary()} (see {summary.run_dir}/gates.json)")
    return GATES_FAILED if not summary.passed and recipe.gates.fail else 0


def _check(args: argparse.Namespace) -> int:
    from pipeline.metrics import STEPS_FILE
    from stages.gates import describe, evaluate_gates
    from stages.run_dir import stopped_at

    directory = Path(args.run_dir)
    if not (directory / STEPS_FILE).is_file():
        raise RecipeError(f"{directory}: no {STEPS_FILE} here: not a run directory")
    source = args.recipe or directory / "recipe.yaml"
    recipe = pipeline.load_recipe(source)
    if not recipe.gates.checks:
        raise RecipeError(f"{source}: gates.checks: the recipe has no gates (give one with --recipe)")
    verdict = evaluate_gates(
        directory, recipe.gates, steps=recipe.run.steps, stopped_at=stopped_at(directory)
    )
    for result in verdict.results:
        print(describe(result))
    print(verdict.summary())
    return 0 if verdict.passed else GATES_FAILED


def _inspect(args: argparse.Namespace) -> int:
    import msgspec

    from stages.checkpoint import describe

    against = msgspec.to_builtins(pipeline.load_recipe(args.recipe)) if args.recipe else None
    print(describe(Path(args.checkpoint), against))
    return 0


def _export(args: argparse.Namespace) -> int:
    from pipeline.shell.model_files import export

    print(f"exported {args.checkpoint} to {export(args.checkpoint, args.out_dir)}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    import msgspec

    from backends.torch.runtime import load

    load()  # before anything imports torch: how its threads wait is read once
    from backends.torch.device import check_device
    from pipeline.shell.generate import check_sampling, generate
    from pipeline.shell.model_files import open_model

    check_sampling(args.max_new_tokens, args.temperature, args.top_p)
    check_device(args.device, "--device")
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


def _plot(args: argparse.Namespace) -> int:
    from pipeline.shell.plot import write_report

    if args.out is None and len(args.run_dirs) > 1:
        raise RecipeError("plot: several runs need --out, e.g. --out compare.png")
    out = Path(args.out) if args.out else Path(args.run_dirs[0]) / "report.png"
    print(f"wrote {write_report([Path(d) for d in args.run_dirs], out)}")
    return 0


def _timeline(args: argparse.Namespace) -> int:
    from pipeline.shell.timeline import write_timeline

    first = last = None
    if args.steps:
        try:
            first, last = (int(part) for part in args.steps.split(":"))
        except ValueError:
            raise RecipeError(f"--steps: expected FIRST:LAST (e.g. 10:12), got {args.steps!r}") from None
    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else run_dir / "timeline.png"
    print(f"wrote {write_timeline(run_dir, out, first=first, last=last)}")
    return 0


COMMANDS = (
    Command(
        "run",
        "train with a recipe",
        (
            "python -m pipeline run recipes/quickstart.yaml",
            "python -m pipeline run recipes/quickstart.yaml --quiet run.steps=20 run.dir=runs/short",
        ),
        _run_arguments,
        _run,
    ),
    Command(
        "validate",
        "check a recipe and the files it names without training",
        (
            "python -m pipeline validate recipes/quickstart.yaml",
            "python -m pipeline validate recipes/gsm8k-qwen2.5-math-1.5b.yaml model.path=models/qwen",
        ),
        _recipe_arguments,
        _validate,
    ),
    Command(
        "inspect",
        "show what a checkpoint holds",
        (
            "python -m pipeline inspect runs/quickstart/checkpoints/step-000200",
            "python -m pipeline inspect runs/quickstart/checkpoints/step-000200 "
            "--recipe recipes/quickstart.yaml",
        ),
        _inspect_arguments,
        _inspect,
    ),
    Command(
        "export",
        "write a checkpoint as a Hugging Face model directory",
        ("python -m pipeline export runs/gsm8k-qwen2.5-math-1.5b/checkpoints/step-000200 exported/",),
        _export_arguments,
        _export,
    ),
    Command(
        "generate",
        "complete one prompt with a checkpoint or a model directory",
        (
            "python -m pipeline generate runs/quickstart/checkpoints/step-000200 --prompt 12349=",
            'python -m pipeline generate exported/ --prompt "What is 12 * 7?" --chat --json',
        ),
        _generate_arguments,
        _generate,
    ),
    Command(
        "plot",
        "a PNG report of one run, or several compared",
        (
            "python -m pipeline plot runs/quickstart",
            "python -m pipeline plot runs/a runs/b --out compare.png",
        ),
        _plot_arguments,
        _plot,
    ),
    Command(
        "timeline",
        "a PNG of a window of a run's trace.json",
        ("python -m pipeline timeline runs/quickstart --steps 100:102",),
        _timeline_arguments,
        _timeline,
    ),
    Command(
        "check",
        "evaluate a recipe's metric gates on a run directory",
        (
            "python -m pipeline check runs/quickstart",
            "python -m pipeline check runs/quickstart --recipe recipes/quickstart.yaml",
        ),
        _check_arguments,
        _check,
    ),
)


async def _run_task(recipe: Any, console: Console | None) -> Any:
    stop = pipeline.StopRequest()
    result: list[Any] = []
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_signals, stop, console)

            async def body() -> None:
                result.append(await pipeline.run(recipe, stop=stop, console=console))
                tg.cancel_scope.cancel()

            tg.start_soon(body)
    except BaseExceptionGroup as group:
        raise first_error(group) from None
    return result[0]


async def _watch_signals(stop: pipeline.StopRequest, console: Console | None) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if stop.requested.is_set():
                if console is not None:
                    console.close()  # the message gets a line of its own, not the status line's
                print(f"second {name}: exiting now", file=sys.stderr, flush=True)
                kill_descendants()  # no clean-up runs: what the run started goes with it
                os._exit(128 + signum)
            stop.request(f"{name} received")
