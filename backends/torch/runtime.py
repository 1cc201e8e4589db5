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


def load() -> None:
    """Set how long OpenMP's threads spin, open libtorch without the GIL, then import torch.

    With torch already imported (by the host application, or an earlier call) it does nothing."""
    global _loaded_here
    if "torch" in sys.modules:
        return
    _loaded_here = True
    _say("loading torch")
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "1000")
    if sys.platform.startswith("linux"):
        _open_libraries()
    import torch  # noqa: F401


def _open_libraries() -> None:
    spec = importlib.util.find_spec("torch")
    dlopen = getattr(ctypes.CDLL(None), "dlopen", None)
    if spec is None or not spec.submodule_search_locations or dlopen is None:
        return  # torch's own import reports a missing torch; without dlopen it loads as usual
    lib = Path(spec.submodule_search_locations[0]) / "lib"
    dlopen.restype = ctypes.c_void_p
    dlopen.argtypes = [ctypes.c_char_p, ctypes.c_int]
    for name, flags in (
        ("libtorch_global_deps.so", os.RTLD_NOW | os.RTLD_GLOBAL),
        ("libtorch_cpu.so", os.RTLD_NOW | os.RTLD_LOCAL),
        ("libtorch_python.so", os.RTLD_NOW | os.RTLD_LOCAL),  # torch._C's own library, beside it
    ):
        # A library that does not open here (another layout) is left to torch's own import.
        if (lib / name).is_file():
            dlopen(str(lib / name).encode(), flags)


def spins_by_default() -> bool:
    """Whether torch came up (before `load`, in the host application) with OpenMP's default
    spinning: neither variable set, so its waiting threads spin 300,000 rounds."""
    return not _loaded_here and "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ
