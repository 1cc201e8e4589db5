"""Recipes: YAML decoded into typed, frozen msgspec Structs.

`load(path, root, overrides)` reads the YAML file, applies dotted `key.path=value` overrides
(values parsed as YAML), and converts the result into `root`. Every failure becomes one
`RecipeError` naming the file, the field path and the fix, e.g.

    recipes/x.yaml: async_rl.max_lookahead_versions: Expected `int` >= 0, got -1

The sections the engine itself owns live here; the RL stages own theirs, and the root recipe
(`stages.recipe.Recipe`) composes them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import yaml

from pipeline.errors import RecipeError

R = TypeVar("R")

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]


class Section(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Base of every recipe section."""


class RunSection(Section):
    dir: str = "runs/quickstart"
    steps: PositiveInt = 100
    seed: int = 0
    stop_grace_s: PositiveFloat = 30.0
    progress: bool = True


class AsyncRLSection(Section):
    max_lookahead_versions: NonNegativeInt = 1


class CheckpointSection(Section):
    every_steps: NonNegativeInt = 0  # 0: only at the last step and on a clean stop
    keep_last: Annotated[int, msgspec.Meta(ge=2)] = 2
    resume: str = "auto"  # "auto", "never" or a checkpoint path


class WatchdogSection(Section):
    stall_s: PositiveFloat = 600.0
    fail: bool = False


class WandbSection(Section):
    enabled: bool = False
    project: str = "grpo-pipeline"
    mode: Literal["offline", "online", "disabled"] = "offline"


_PATH_RE = re.compile(r" - at `\$\.?([^`]*)`$")
_FLOATISH = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


def load(path: str | Path, root: type[R], overrides: Sequence[str] = ()) -> R:
    """Read `path`, apply `overrides`, convert to `root`; raise `RecipeError` on any problem."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise RecipeError(f"{path}: recipe file not found") from None
    except OSError as error:
        raise RecipeError(f"{path}: cannot read recipe: {error.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise RecipeError(f"{path}: invalid YAML: {_yaml_problem(error)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping of sections, got {type(data).__name__}")
    for override in overrides:
        _apply_override(data, override, path)
    return convert(data, root, source=str(path))


def convert(data: dict[str, Any], root: type[R], *, source: str) -> R:
    try:
        return msgspec.convert(data, root, strict=True)
    except msgspec.ValidationError as error:
        raise RecipeError(_validation_message(str(error), data, source)) from None


def _validation_message(message: str, data: dict[str, Any], source: str) -> str:
    match = _PATH_RE.search(message)
    field = match.group(1) if match else ""
    problem = _PATH_RE.sub("", message)
    unknown = re.match(r"Object contains unknown field `([^`]+)`", problem)
    if unknown:
        field = f"{field}.{unknown.group(1)}" if field else unknown.group(1)
        problem = "unknown field (check the spelling; see the recipe reference in README.md)"
    missing = re.match(r"Object missing required field `([^`]+)`", problem)
    if missing:
        field = f"{field}.{missing.group(1)}" if field else missing.group(1)
        problem = "required field is missing"
    value = _lookup(data, field)
    if isinstance(value, str) and _FLOATISH.match(value.strip()) and "`float`" in problem:
        mantissa, exponent = value.strip().lower().split("e")
        if "." not in mantissa:
            mantissa += ".0"
        problem += f" ({value!r}): YAML reads {value} as a string, write {mantissa}e{exponent}"
    return f"{source}: {field or '<root>'}: {problem}"


def _lookup(data: Any, field: str) -> Any:
    node = data
    for part in re.findall(r"[^.\[\]]+", field):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _apply_override(data: dict[str, Any], override: str, path: Path) -> None:
    key, sep, raw = override.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise RecipeError(f"override {override!r}: expected key.path=value, e.g. run.steps=20")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RecipeError(f"override {override!r}: {part} in {path} is not a section")
        node = child
    node[parts[-1]] = value


def _yaml_problem(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    if mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return problem


def dump(recipe: msgspec.Struct) -> str:
    """The resolved recipe as YAML (what `run.dir/recipe.yaml` holds)."""
    return yaml.safe_dump(msgspec.to_builtins(recipe), sort_keys=False)
