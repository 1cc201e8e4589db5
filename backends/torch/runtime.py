"""How torch's native runtime comes up in this process: `load()` before the first `import torch`
(`backends.registry` calls it before it imports a backend module, all of which import torch;
the pipeline does so on a worker thread).

- How long OpenMP's waiting threads spin. libgomp, which torch's CPU build uses, lets a thread
  that finished its share of a parallel region spin for the next one (300,000 rounds by
  default) before it sleeps. Beside another busy process that spinning takes the cores the
  working threads need: the quickstart next to one CPU-bound process took 109 s and 103 s of
  user CPU instead of 23 s. `GOMP_SPINCOUNT=1000` spins briefly, then sleeps: 36 s beside the
  same process, and alone within a few percent of the default's wall time with less CPU.
  (`OMP_WAIT_POLICY=PASSIVE`, no spinning at all, made the quickstart alone 1.6x slower: a
  futex round trip for each of its many small parallel regions.) libgomp reads it once, when
  torch loads it, so `load` sets it first, unless the user set either variable.
- Loading libtorch without the GIL. Its static initialisers run inside `dlopen` (1-1.5 s
  here), and Python holds the GIL through an extension module's `dlopen`, so even an import on a
  worker thread froze the event loop for that long. The libraries are opened first through a
  foreign call (ctypes releases the GIL around it) with the flags torch itself uses: its global
  dependencies `RTLD_GLOBAL`, libtorch_cpu and libtorch_python (which `torch._C` links) local.
  torch's own import then finds them loaded; what is left under the GIL is `torch._C`'s
  initialisation itself.
- Loading Triton's library without the GIL. torch imports Triton where it is installed, a CPU
  run included (building an optimizer imports dynamo, which imports Triton), and
  `triton._C.libtriton` (LLVM inside) held the GIL through its `dlopen`, long enough from a
  cold disk cache to stall an embedding host's event loop past 50 ms as a run began
  (bench/results-cpu.json, sections host_loop_cold*_2026-12-04). It is opened the same way
  first (local, as Python's import opens it), also where the host imported torch itself.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import sys
from pathlib import Path

# The pipeline's start-up narration (pipeline/startup.py), named, not imported: a backend
# imports nothing of the pipeline.
_say = logging.getLogger("pipeline.startup").info


_loaded_here = False  # whether `load` brought torch up (else the host did, before it)
_opened: set[str] = set()  # the packages whose libraries `load` opened (or tried to)


def load() -> None:
    """Set how long OpenMP's threads spin, open libtorch without the GIL, then import torch;
    then open Triton's library without the GIL, where Triton is installed and not yet imported.

    With torch already imported (by the host application, or an earlier call) only the last,
    once a process."""
    global _loaded_here
    linux = sys.platform.startswith("linux")
    if "torch" not in sys.modules:
        _loaded_here = True
        _say("loading torch")
        if "OMP_WAIT_POLICY" not in os.environ:
            os.environ.setdefault("GOMP_SPINCOUNT", "1000")
        if linux:
            _open_libraries("torch")
        import torch  # noqa: F401
    if linux and "triton" not in sys.modules and "triton" not in _opened:
        _open_libraries("triton")


# Each package's libraries, by their paths in it, and whether its own import opens them global
# (else local; all at once, `RTLD_NOW`, as Python opens extension modules).
LIBRARIES = {
    "torch": (
        ("lib/libtorch_global_deps.so", True),
        ("lib/libtorch_cpu.so", False),
        ("lib/libtorch_python.so", False),  # torch._C's own library, beside it
    ),
    "triton": (("_C/libtriton.so", False),),
}


def _open_libraries(package: str) -> None:
    """Open ``package``'s `LIBRARIES` by a foreign call, which releases the GIL (Linux only:
    the flags are POSIX's)."""
    _opened.add(package)
    spec = importlib.util.find_spec(package)
    dlopen = getattr(ctypes.CDLL(None), "dlopen", None)
    if spec is None or not spec.submodule_search_locations or dlopen is None:
        return  # a missing package is its own import's to report; without dlopen it loads as usual
    root = Path(spec.submodule_search_locations[0])
    dlopen.restype = ctypes.c_void_p
    dlopen.argtypes = [ctypes.c_char_p, ctypes.c_int]
    for name, shared in LIBRARIES[package]:
        # A library that does not open here (another layout) is left to the package's import.
        if (root / name).is_file():
            dlopen(str(root / name).encode(), os.RTLD_NOW | (os.RTLD_GLOBAL if shared else os.RTLD_LOCAL))


def spins_by_default() -> bool:
    """Whether torch came up (before `load`, in the host application) with OpenMP's default
    spinning: neither variable set, so its waiting threads spin 300,000 rounds."""
    return not _loaded_here and "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ
