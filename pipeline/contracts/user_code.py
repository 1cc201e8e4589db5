"""A user's module, named by a recipe field as `module:function` (a reward function, an
environment, a loss or an advantage): `import_named` imports it and turns every way its import
can fail into one `RecipeError` naming the field, the module and where it failed, instead of a
traceback (or, for a module that calls `sys.exit`, a silent exit with its code)."""

from __future__ import annotations

import importlib
import traceback
from types import ModuleType

from pipeline.contracts.errors import RecipeError


def import_named(field: str, module_name: str) -> ModuleType:
    """`module_name` imported; `RecipeError` (`field: cannot import module ...`) if it fails."""
    try:
        return importlib.import_module(module_name)
    except SyntaxError as error:  # its source does not parse (or is not UTF-8)
        where = f"{error.filename}, line {error.lineno}" if error.lineno else error.filename
        problem = f"{error.msg} ({where})"
    except ImportError as error:
        problem = str(error)
    except (Exception, SystemExit) as error:  # the module's own code failed as it ran
        last = traceback.extract_tb(error.__traceback__)[-1]
        problem = f"{type(error).__name__}: {error} ({last.filename}, line {last.lineno})"
    raise RecipeError(f"{field}: cannot import module {module_name!r}: {problem}")
