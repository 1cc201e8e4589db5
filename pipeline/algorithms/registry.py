"""Registries of named algorithm parts, and `module:function` for a user's own.

Each kind (advantage estimators, policy losses, loss aggregations) is one `Registry`; a part
registers itself with the decorator where it is defined, so a new variant is one function in
one module plus its decorator line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from pipeline.contracts.errors import RecipeError
from pipeline.contracts.user_code import import_named

F = TypeVar("F", bound=Callable[..., object])


class Registry(Generic[F]):
    """Named functions of one kind; `get` also takes `module:function`."""

    def __init__(self, kind: str, field: str) -> None:
        self.kind = kind
        self.field = field  # the recipe field that names one, for errors
        self._parts: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def add(fn: F) -> F:
            assert name not in self._parts, f"{self.kind} {name!r} registered twice"
            self._parts[name] = fn
            return fn

        return add

    @property
    def names(self) -> list[str]:
        return sorted(self._parts)

    def get(self, name: str) -> F:
        """The part `name` names; a `module:function` is imported. Raises `RecipeError` naming
        the recipe field for a name that is neither."""
        if name in self._parts:
            return self._parts[name]
        if ":" not in name:
            raise RecipeError(
                f"{self.field}: unknown {self.kind} {name!r}; choose one of {', '.join(self.names)} "
                "or name your own as module:function"
            )
        module_name, _, attr = name.partition(":")
        module = import_named(self.field, module_name)
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise RecipeError(f"{self.field}: module {module_name!r} has no function {attr!r}")
        return fn  # type: ignore[no-any-return]
