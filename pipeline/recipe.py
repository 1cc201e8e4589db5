"""Recipes: YAML decoded into typed, frozen msgspec Structs.

`load(path, root, overrides)` reads the YAML file, applies dotted `key.path=value` overrides
(values parsed as YAML), and converts the result into `root`. Every failure becomes one
`RecipeError` naming the file, the field path and the fix, e.g.

    recipes/x.yaml: async_rl.max_lookahead_versions: Expected `int` >= 0, got -1

The section types (the base and the engine's own sections) are contracts
(`pipeline.contracts.sections`); the RL stages own theirs, and the root recipe
(`pipeline.shell.recipe.Recipe`) composes them.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import msgspec.inspect
import yaml

from pipeline.contracts.errors import RecipeError
from pipeline.contracts.text import NotText, decode, read_text

R = TypeVar("R")

_PATH_RE = re.compile(r" - at `\$\.?([^`]*)`$")
_FLOATISH = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


def load(path: str | Path, root: type[R], overrides: Sequence[str] = ()) -> R:
    """Read `path`, apply `overrides`, convert to `root`; raise `RecipeError` on any problem."""
    path = Path(path)
    try:
        text = read_text(path)
    except FileNotFoundError:
        raise RecipeError(f"{path}: recipe file not found") from None
    except OSError as error:
        raise RecipeError(f"{path}: cannot read recipe: {error.strerror}") from None
    except NotText as error:
        raise RecipeError(f"{error}; save it as UTF-8") from None
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
    return convert(data, root, source=str(path), overrides=overrides)


def convert(data: dict[str, Any], root: type[R], *, source: str, overrides: Sequence[str] = ()) -> R:
    """`data` as `root`; every number in a recipe is finite (YAML reads `.inf` and `.nan` as
    floats, which pass a bound such as `> 0`)."""
    found = _non_finite(data)
    if found is not None:
        field, value = found
        where = _attributed(source, field, overrides)
        raise RecipeError(f"{where}: {field}: Expected a finite number, got {value!r}")
    try:
        return msgspec.convert(data, root, strict=True)
    except msgspec.ValidationError as error:
        raise RecipeError(_validation_message(str(error), data, source, root, overrides)) from None


def _non_finite(data: Any, path: str = "") -> tuple[str, float] | None:
    """The first field (dotted path) holding a non-finite float, and its value."""
    if isinstance(data, float) and not math.isfinite(data):
        return path, data
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        inner = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
        found = _non_finite(value, inner)
        if found is not None:
            return found
    return None


def _attributed(source: str, field: str, overrides: Sequence[str]) -> str:
    """`source`, or `source: override 'x=y'` where an override set `field` (or a part of it)."""
    for override in overrides:
        key = override.partition("=")[0]
        inside = field.startswith((key + ".", key + "["))
        if field and (key == field or key.startswith(field + ".") or inside):
            return f"{source}: override {override!r}"
    return source


def _validation_message(
    message: str, data: dict[str, Any], source: str, root: type, overrides: Sequence[str] = ()
) -> str:
    match = _PATH_RE.search(message)
    field = match.group(1) if match else ""
    problem = _PATH_RE.sub("", message)
    unknown = re.match(r"Object contains unknown field `([^`]+)`", problem)
    missing = re.match(r"Object missing required field `([^`]+)`", problem)
    value = lookup(data, field)
    if unknown:
        name = unknown.group(1)
        known = _field_names(_type_at(root, data, field))
        field = f"{field}.{name}" if field else name
        problem = "unknown field"
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        if close:
            problem += f" (did you mean `{close[0]}`?)"
        if known:
            problem += f"; valid fields: {', '.join(known)}"
    elif missing:
        field = f"{field}.{missing.group(1)}" if field else missing.group(1)
        problem = "required field is missing"
    elif isinstance(value, str) and _FLOATISH.match(value.strip()) and "`float" in problem:
        mantissa, exponent = value.strip().lower().split("e")
        if "." not in mantissa:
            mantissa += ".0"
        if not exponent.startswith(("+", "-")):  # YAML 1.1 reads a float's exponent signed only
            exponent = "+" + exponent
        problem += f" ({value!r}): YAML reads {value} as a string, write {mantissa}e{exponent}"
    elif problem.startswith("Invalid"):
        choices = _choices(root, data, field)
        if choices:
            problem += f"; expected one of: {', '.join(choices)}"
    elif problem.startswith("Expected") and value is not None and not isinstance(value, (dict, list)):
        # msgspec names the expected type or bound; the user also needs to see what they wrote.
        problem += f" ({value!r})" if ", got `" in problem else f", got {value!r}"
    source = _attributed(source, field, overrides)
    # A cross-section rule (a root `__post_init__`) names its own fields.
    return f"{source}: {field}: {problem}" if field else f"{source}: {problem}"


def _type_at(root: type, data: Any, field: str) -> Any:
    """The `msgspec.inspect` type at a dotted field path (tagged unions resolved from `data`)."""
    info = _unwrap(msgspec.inspect.type_info(root), data)
    node = data
    for part in re.findall(r"[^.\[\]]+", field):
        if isinstance(info, msgspec.inspect.CollectionType) and part.isdigit():  # a list's item
            node = node[int(part)] if isinstance(node, list) and int(part) < len(node) else None
            info = _unwrap(info.item_type, node)
            continue
        if not isinstance(info, msgspec.inspect.StructType):
            return None
        found = next((f for f in info.fields if f.encode_name == part), None)
        if found is None:
            return None
        node = node.get(part) if isinstance(node, dict) else None
        info = _unwrap(found.type, node)
    return info


def _unwrap(info: Any, node: Any) -> Any:
    """Drop `None` from optional types; pick the tagged-union member that `node` names."""
    if not isinstance(info, msgspec.inspect.UnionType):
        return info
    members = [t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
    structs = [t for t in members if isinstance(t, msgspec.inspect.StructType)]
    if len(members) == 1:
        return members[0]
    if structs and isinstance(node, dict):
        for struct in structs:
            if struct.tag_field is not None and node.get(struct.tag_field) == struct.tag:
                return struct
    return info


def _field_names(info: Any) -> list[str]:
    if isinstance(info, msgspec.inspect.StructType):
        return [f.encode_name for f in info.fields]
    return []


def _choices(root: type, data: Any, field: str) -> list[str]:
    """The values a Literal field or a tagged union's tag field accepts."""
    info = _type_at(root, data, field)
    if isinstance(info, msgspec.inspect.LiteralType):
        return [str(v) for v in info.values]
    parent, _, name = field.rpartition(".")
    union = _type_at(root, data, parent)
    if isinstance(union, msgspec.inspect.UnionType):
        return sorted(
            str(t.tag)
            for t in union.types
            if isinstance(t, msgspec.inspect.StructType) and t.tag_field == name
        )
    return []


def lookup(data: Any, field: str) -> Any:
    """The value at a dotted field path of decoded YAML, or None where there is none."""
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
    try:  # the command line's bytes, as Python kept them (undecodable ones as surrogates)
        decode(override.encode("utf-8", "surrogateescape"), f"override {override!r}")
    except NotText as error:
        raise RecipeError(str(error)) from None
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
