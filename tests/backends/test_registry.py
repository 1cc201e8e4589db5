"""The backend registry: `train.backend` names the module that builds the engine and trainer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backends.registry import build_backend
from backends.torch.config import ModelConfig
from backends.torch.engine import TorchEngine
from backends.torch.section import ModelSection
from backends.torch.trainer import TorchTrainer
from pipeline.contracts.errors import RecipeError
from pipeline.shell.backend_input import backend_input
from pipeline.shell.recipe import Recipe

ROOT = Path(__file__).parents[2]


def test_the_default_backend_builds_the_torch_engine_and_trainer_sharing_one_model() -> None:
    """Catches a registry that maps `torch` to the wrong module or drops the recipe's options."""
    engine, trainer = build_backend(backend_input(Recipe()), vocab_size=16, stop_ids=(1,))
    try:
        assert isinstance(engine, TorchEngine) and isinstance(trainer, TorchTrainer)
        assert engine.source is trainer.model  # colocated: one set of weights
    finally:
        trainer.close()


def test_a_model_directory_the_backend_cannot_load_is_a_model_path_error(tmp_path: Path) -> None:
    """The torch backend's load errors reach the user as bad input naming `model.path`."""
    (tmp_path / "config.json").write_text(json.dumps(ModelConfig(vocab_size=16).to_hf_dict()))
    recipe = Recipe(model=ModelSection(path=str(tmp_path)))
    with pytest.raises(RecipeError) as raised:
        build_backend(backend_input(recipe), vocab_size=16, stop_ids=(1,))
    assert str(raised.value) == (
        f"model.path: {tmp_path}: missing model.safetensors (and no model.safetensors.index.json)"
    )


def test_a_backend_module_is_imported_only_after_torch_came_up_prepared() -> None:
    """A backend module imports torch at its top: imported before `runtime.load`, torch comes up
    with OpenMP's default spinning (which beside other busy processes made the quickstart's
    steps 8x slower) and libtorch opened under the GIL. `check` is the first thing `validate`
    and `run` ask of the registry."""
    program = (
        "import os, sys; import pipeline; from backends import registry; "
        "from pipeline.shell.backend_input import backend_input; "
        "registry.check(backend_input(pipeline.load_recipe('recipes/quickstart.yaml'))); "
        "print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == ["1000", "True"]


def test_a_host_that_imported_torch_with_default_spinning_is_told_how_to_fix_it() -> None:
    """torch reads how its threads wait once, as it loads: a host that imported it first cannot
    be fixed from here, so the build says what to do (once), for a CPU model of several threads."""
    program = (
        "import torch, msgspec; from backends.registry import build_backend; "
        "from pipeline.shell.recipe import Recipe; from pipeline.shell.backend_input import backend_input; "
        "recipe = Recipe(); "
        "model = msgspec.structs.replace(recipe.model, threads=2); "
        "recipe = msgspec.structs.replace(recipe, model=model); "
        "build_backend(backend_input(recipe), vocab_size=16, stop_ids=(1,))[1].close()"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert done.stderr.splitlines() == [
        "torch was imported before the pipeline with OpenMP's default spinning: beside other busy "
        "processes its 2 threads can make steps many times slower; set GOMP_SPINCOUNT=1000 in the "
        "environment before importing torch (or model.threads: 1)"
    ]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the libraries are opened on Linux")
@pytest.mark.parametrize("host_imported_torch", [False, True])
def test_tritons_library_is_opened_without_the_gil_before_anything_imports_triton(
    host_imported_torch: bool,
) -> None:
    """torch imports Triton where it is installed (building an optimizer does, on CPU too), and
    Python's import opens `libtriton.so` holding the GIL (long, from a cold disk cache): `load`
    opens it first by a foreign call, also where the host imported torch itself."""
    pytest.importorskip("triton")
    program = (
        f"import sys; {'import torch; ' if host_imported_torch else ''}"
        "from backends.torch import runtime; runtime.load(); "
        "print('libtriton.so' in open('/proc/self/maps').read(), 'triton' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == ["True", "False"], done.stderr


def test_the_runtime_module_imports_where_os_has_no_dlopen_flags() -> None:
    """`os.RTLD_*` are POSIX's (Windows has none): the module reads them only where it opens
    libraries, on Linux, so importing it (the CLI, the registry and preflight do) works anywhere."""
    program = (
        "import os\n"
        "for name in ('RTLD_NOW', 'RTLD_GLOBAL', 'RTLD_LOCAL'):\n"
        "    delattr(os, name)\n"
        "import backends.torch.runtime\n"
        "print('imported')\n"
    )
    done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True)
    assert done.stdout.split() == ["imported"], done.stderr
