"""The command line's grammar: subcommands, their flags and examples, and one parse.

Flags go anywhere, as people put them: `run recipe.yaml --quiet run.steps=5` and
`--log-level debug run recipe.yaml` both parse. The global flags (`--log-level`) are accepted
before or after the subcommand; each subcommand's own flags anywhere after its name (its
parser reads flags and positionals intermixed). A mistake is one `error:` line that names the
command and shows its first example, exit code 2.

A subcommand is one `Command` in the table the CLI hands to `parse`: adding one is adding a
row (its name, one line of help, examples, a function that declares its arguments, the function that runs it).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import NoReturn

PROG = "python -m pipeline"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    examples: tuple[str, ...]
    arguments: Callable[[argparse.ArgumentParser], None]
    handler: Callable[[argparse.Namespace], int]


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: what is wrong and an example that works."""

    example: str | None = None

    def error(self, message: str) -> NoReturn:
        hint = f"; e.g. {self.example}" if self.example else ""
        self.exit(2, f"error: {self.prog}: {message}{hint} (see {self.prog} --help)\n")


def version() -> str:
    try:
        return metadata.version("grpo-pipeline")
    except metadata.PackageNotFoundError:  # run from a checkout without `pip install -e .`
        return "unknown (not installed)"


def _global_flags(parser: argparse.ArgumentParser, *, default: str | None) -> None:
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        metavar="{debug,info,warning,error}",
        default=default if default is not None else argparse.SUPPRESS,
        help="the least severe log records shown (default info)",
    )


def _parsers(commands: Sequence[Command]) -> tuple[_Parser, dict[str, _Parser]]:
    top = _Parser(
        prog=PROG,
        description="Asynchronous GRPO trainer.",
        epilog="examples:\n" + "\n".join(f"  {c.examples[0]}" for c in commands),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    top.example = commands[0].examples[0]
    top.add_argument("--version", action="version", version=f"grpo-pipeline {version()}")
    _global_flags(top, default=None)
    sub = top.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    parsers: dict[str, _Parser] = {}
    for command in commands:
        parser = sub.add_parser(
            command.name,
            help=command.help,
            description=command.help[:1].upper() + command.help[1:] + ".",
            epilog="examples:\n" + "\n".join(f"  {e}" for e in command.examples),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        parser.example = command.examples[0]
        command.arguments(parser)
        _global_flags(parser, default="INFO")
        parsers[command.name] = parser
    return top, parsers


def parse(commands: Sequence[Command], argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The parsed command line: `command` (its name), `handler`, `log_level`, and its arguments.

    `--help`, `--version` and a missing or unknown command print and exit, as argparse does."""
    args = list(sys.argv[1:] if argv is None else argv)
    top, parsers = _parsers(commands)
    position = _command_position(args)
    if (
        position is None
        or args[position] not in parsers
        or {"-h", "--help", "--version"} & set(args[:position])
    ):
        top.parse_args(args)  # prints help or the version, or the one-line error; exits
        raise AssertionError("argparse returned without a command")
    # Global flags given before the command move behind it, where its parser reads them.
    rest = args[position + 1 :] + args[:position]
    namespace = parsers[args[position]].parse_intermixed_args(rest)
    namespace.command = args[position]
    namespace.handler = next(c.handler for c in commands if c.name == args[position])
    return namespace


def _command_position(args: list[str]) -> int | None:
    """Index of the first argument that is neither a global flag nor a global flag's value."""
    skip_value = False
    for i, arg in enumerate(args):
        if skip_value:
            skip_value = False
        elif arg == "--log-level":
            skip_value = True
        elif not arg.startswith("-"):
            return i
    return None
