"""A user's module, named by a recipe field as `module:function` (a reward function, an
environment, a loss or an advantage): `import_named` imports it and turns every way its import
can fail into one `RecipeError` naming the field, the module and where it failed, instead of a
traceback (or, for a module that calls `sys.exit`, a silent exit with its code)."""

from __future__ import annotations

import importlib
import os
import sysconfig
import traceback
from types import ModuleType, TracebackType

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
        frame = _own_frame(error.__traceback__)
        problem = f"{type(error).__name__}: {error} ({frame.filename}, line {frame.lineno})"
    raise RecipeError(f"{field}: cannot import module {module_name!r}: {problem}")


def _own_frame(trace: TracebackType | None) -> traceback.FrameSummary:
    """Where the user's code failed: the innermost frame outside the standard library, the
    installed packages and importlib's machinery (not inside a library the module called, nor
    inside a hook a library put on `sys.exit`, as wandb does); the innermost frame if every
    one is there (a user's module installed as a package)."""
    frames = traceback.extract_tb(trace)
    paths = sysconfig.get_paths()
    libraries = tuple({paths[name] + os.sep for name in ("stdlib", "platstdlib", "purelib", "platlib")})
    own = [f for f in frames if not f.filename.startswith(("<", *libraries))]
    return (own or frames)[-1]
