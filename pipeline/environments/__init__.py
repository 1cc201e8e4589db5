"""Environments for multi-turn rollouts: `resolve` from the recipe's `module:Class`, and the
built-in CPU game (`pipeline.environments.guess`). Imports the contracts only."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from pipeline.contracts.environments import Environment
from pipeline.contracts.errors import RecipeError
from pipeline.contracts.user_code import import_named

EnvironmentFactory = Callable[[], Environment]


def resolve(name: str, args: Mapping[str, Any]) -> EnvironmentFactory:
    """A factory building one environment per episode: `module:Class` called with `args`.

    Raises `RecipeError` naming `rollout.environment` when the module does not import, the
    class is missing, or `args` do not fit its constructor (checked once here, by building
    one, so a misspelt argument fails at start rather than at the first episode).
    """
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise RecipeError(f"rollout.environment: {name!r} is not module:Class")
    module = import_named("rollout.environment", module_name)
    cls = getattr(module, attr, None)
    if not callable(cls):
        raise RecipeError(f"rollout.environment: module {module_name!r} has no class {attr!r}")
    missing = [m for m in ("start", "step") if not inspect.iscoroutinefunction(getattr(cls, m, None))]
    if missing:
        raise RecipeError(
            f"rollout.environment: {name} needs async methods start(prompt) and step(turn); "
            f"missing or not async: {', '.join(missing)}"
        )
    kwargs = dict(args)
    try:
        cls(**kwargs)
    except (TypeError, ValueError) as error:
        raise RecipeError(f"rollout.environment_args: {name}: {error}") from None
    return lambda: cls(**kwargs)
