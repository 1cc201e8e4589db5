"""The command line: `python -m pipeline run|validate RECIPE [key.path=value ...]`, and
`inspect CHECKPOINT`, `export CHECKPOINT OUT_DIR`, `generate MODEL --prompt TEXT`.

Exit codes: 0 success or clean stop, 1 a run error the user can act on, 2 a bad recipe or
command line, 128+N a second signal N (exits at once).
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
from pipeline.errors import PipelineError, StageFailed
from pipeline.runner import first_error

log = logging.getLogger("pipeline")


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
        command.add_argument("--quiet", action="store_true", help="no per-step progress lines")
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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "inspect":
            return _inspect(args.checkpoint, args.recipe)
        if args.command == "export":
            return _export(args.checkpoint, args.out_dir)
        if args.command == "generate":
            return _generate(args)
        recipe = pipeline.load_recipe(args.recipe, args.overrides)
        if args.command == "validate":
            print(f"{args.recipe}: ok")
            return 0
        echo = None if args.quiet or not recipe.run.progress else _echo(recipe.run.steps)
        summary = anyio.run(_run, recipe, echo, backend_options={"use_uvloop": True})
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
    return 0


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


async def _run(recipe: Any, echo: Any) -> Any:
    stop = pipeline.StopRequest()
    result: list[Any] = []
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_signals, stop)

            async def body() -> None:
                result.append(await pipeline.run(recipe, stop=stop, echo=echo))
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


def _echo(total: int) -> Any:
    def echo(record: dict[str, Any]) -> None:
        parts = [f"step {record.get('step', '?')}/{total}"]
        for key, label in (
            ("reward/mean", "reward"),
            ("eval/reward", "eval reward"),
            ("eval/exact_match", "eval exact"),
            ("rollout/max_lag", "lag"),
            ("timing/step_s", "s/step"),
        ):
            if key in record:
                value = record[key]
                parts.append(f"{label} {value:.3f}" if isinstance(value, float) else f"{label} {value}")
        print("  ".join(parts), flush=True)

    return echo
