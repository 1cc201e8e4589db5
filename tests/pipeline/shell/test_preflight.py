"""`validate` runs every check of `run` that needs no weights, with the same one-line errors."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pipeline
from pipeline.contracts.errors import RecipeError
from pipeline.shell.preflight import preflight

ROOT = Path(__file__).parents[3]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
GSM8K = ROOT / "recipes" / "gsm8k-qwen2.5-math-1.5b.yaml"
MULTI_TURN = ROOT / "recipes" / "multi-turn-cpu.yaml"
CPU_BUILD = torch.version.cuda is None
CPU_TORCH = (
    f"model.device: 'cuda', but this torch ({torch.__version__}) is a CPU build; "
    "install a CUDA build of torch, or use cpu"
)


@pytest.fixture(autouse=True)
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Relative paths (the recipes' run.dir, gsm8k's model.path) resolve in an empty folder, so
    a finished runs/quickstart in the checkout does not change what is checked."""
    monkeypatch.chdir(tmp_path)


def check(recipe: Path, *overrides: str) -> str:
    with pytest.raises(RecipeError) as error:
        preflight(pipeline.load_recipe(recipe, overrides))
    return str(error.value)


def test_the_backends_own_refusals_come_before_the_run() -> None:
    """`validate` refuses what the megatron backend would refuse at build (it said ok, then
    `run` failed)."""
    assert check(QUICKSTART, "train.backend=megatron", "train.kl_coef=0.1").startswith(
        "train.kl_coef: 0.1 needs a reference model"
    )


def test_a_missing_model_directory_is_named_before_its_files() -> None:
    assert check(GSM8K) == (
        "model.path: models/qwen2.5-math-1.5b-instruct: no such directory; fetch the model into it "
        "first, e.g. huggingface-cli download ORG/NAME --local-dir models/qwen2.5-math-1.5b-instruct"
    )


def test_new_tokens_past_a_learned_position_table_name_the_field() -> None:
    assert check(QUICKSTART, "rollout.max_new_tokens=30") == (
        "rollout.max_new_tokens: 30 new tokens after the longest prompt (7 tokens) exceed "
        "model.config.max_position_embeddings 32 (learned position embeddings); set it to at most 25"
    )
    preflight(pipeline.load_recipe(QUICKSTART, ["rollout.max_new_tokens=25"]))  # exactly fits


def test_new_tokens_past_a_rotary_models_context_name_the_field() -> None:
    """A rotary model has no position table, but its context bounds what a run may size (a
    billion new tokens made the engine ask for 65 TB)."""
    rotary = ("model.config.learned_position_embeddings=false", "model.config.max_position_embeddings=64")
    assert check(QUICKSTART, *rotary, "rollout.max_new_tokens=1000000000") == (
        "rollout.max_new_tokens: 1000000000 new tokens after the longest prompt (7 tokens) exceed "
        "model.config.max_position_embeddings 64 (the context the model is built for); set it to at most 57"
    )
    preflight(pipeline.load_recipe(QUICKSTART, [*rotary, "rollout.max_new_tokens=57"]))  # exactly fits


def test_a_model_whose_weights_outgrow_the_machine_is_refused_before_it_is_built() -> None:
    """A billion layers asked the allocator for 549,000 GiB and ended the run in a traceback."""
    assert check(QUICKSTART, "model.config.num_hidden_layers=1000000000").startswith(
        "model.config: a model of 1.47e+14 parameters needs 5.49e+05 GiB for its float32 weights "
        "alone, more than this machine's "
    )
    assert check(QUICKSTART, "model.config.num_hidden_layers=1000000000", "model.dtype=bfloat16").startswith(
        "model.config: a model of 1.47e+14 parameters needs 2.75e+05 GiB for its bfloat16 weights"
    )


def test_rows_whose_kv_cache_outgrows_the_machine_are_refused() -> None:
    """A trillion samples a prompt ended the run in a MemoryError's traceback; a trillion prompts
    a step filled memory for minutes; `rollout.max_rows` asked the allocator for petabytes."""
    assert check(QUICKSTART, "rollout.samples_per_prompt=1000000000000").startswith(
        "prompts.prompts_per_step x rollout.samples_per_prompt: 64000000000000 rows (two batches at "
        "L >= 1) of 12 positions need 7.32e+08 GiB of KV cache, more than this machine's "
    )
    assert check(QUICKSTART, "rollout.max_rows=1000000000000").startswith(
        "rollout.max_rows: 1000000000000 rows of 12 positions need 1.14e+07 GiB of KV cache"
    )


def test_episode_rows_whose_kv_cache_outgrows_the_machine_are_refused() -> None:
    """An episode's row caches its prompt and up to `rollout.max_episode_tokens` more (its turns'
    and the environment's), not `max_new_tokens`: 512 rows of 10^8 positions passed."""
    assert check(
        MULTI_TURN,
        "model.config.learned_position_embeddings=false",
        "model.config.max_position_embeddings=1000000000",
        "rollout.max_episode_tokens=100000000",
    ).startswith(
        "prompts.prompts_per_step x rollout.samples_per_prompt: 512 rows (two batches at L >= 1) of "
    )


def test_digits_past_the_model_are_refused_before_the_prompts_are_built() -> None:
    assert check(QUICKSTART, "prompts.source.max_digits=1000000000") == (
        "prompts.source.max_digits: 1000000000 digits cannot fit model.config.max_position_embeddings "
        "32 (learned position embeddings)"
    )


def test_a_reward_module_with_a_syntax_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken_reward.py").write_text("def score(prompt, completion):\n    return 1 +\n")
    (tmp_path / "latin_reward.py").write_bytes(b'NAME = "caf\xe9"\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    assert check(QUICKSTART, "reward.function=broken_reward:score") == (
        f"reward.function: cannot import module 'broken_reward': invalid syntax "
        f"({tmp_path / 'broken_reward.py'}, line 2)"
    )
    assert check(QUICKSTART, "reward.function=latin_reward:score") == (
        "reward.function: cannot import module 'latin_reward': (unicode error) 'utf-8' codec can't "
        f"decode byte 0xe9 in position 3: unexpected end of data ({tmp_path / 'latin_reward.py'}, line 1)"
    )


def test_a_reward_module_that_fails_as_it_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its own code raising (a traceback, exit 1, before) or calling sys.exit (a silent exit with
    the module's code, here 3, which reads as failed gates) is one line, exit 2."""
    (tmp_path / "raising_reward.py").write_text("TABLE = {}\nWEIGHT = 1 / len(TABLE)\n")
    (tmp_path / "exiting_reward.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert check(QUICKSTART, "reward.function=raising_reward:score") == (
        "reward.function: cannot import module 'raising_reward': ZeroDivisionError: division by zero "
        f"({tmp_path / 'raising_reward.py'}, line 2)"
    )
    assert check(QUICKSTART, "reward.function=exiting_reward:score") == (
        "reward.function: cannot import module 'exiting_reward': SystemExit: 3 "
        f"({tmp_path / 'exiting_reward.py'}, line 2)"
    )


def test_where_a_reward_module_failed_is_its_own_line_not_a_library_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The line named is the module's own: not the standard library's where its call raised,
    nor wandb's, whose exit hooks (installed by a wandb run earlier in the process, as in an
    embedding host) wrap `sys.exit`."""
    from wandb.sdk.lib.exit_hooks import ExitHooks

    (tmp_path / "parsing_reward.py").write_text('import json\n\nTABLE = json.loads("{")\n')
    (tmp_path / "exiting_reward.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "exit", sys.exit)  # restored after the test, as is the excepthook
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    ExitHooks().hook()
    assert check(QUICKSTART, "reward.function=parsing_reward:score").endswith(
        f"({tmp_path / 'parsing_reward.py'}, line 3)"
    )
    assert check(QUICKSTART, "reward.function=exiting_reward:score") == (
        "reward.function: cannot import module 'exiting_reward': SystemExit: 3 "
        f"({tmp_path / 'exiting_reward.py'}, line 2)"
    )


def test_a_data_file_that_is_not_utf8(tmp_path: Path) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "3"}\n')
    source = f"prompts.source={{kind: jsonl, path: {data}}}"
    assert check(QUICKSTART, source, "eval.every_steps=0") == (
        f"{data}:2: not UTF-8 text: byte 0xe9 at column 16; save it as UTF-8"
    )


def test_a_checkpoint_whose_recipe_is_not_utf8(tmp_path: Path) -> None:
    import anyio

    from pipeline.shell.run import run_program
    from pipeline.testing import FakeEngine, FakeTrainer

    run_dir = tmp_path / "run"
    overrides = [
        f"run.dir={run_dir}",
        "run.steps=1",
        "eval.every_steps=0",
        "gates.checks=[]",
        "run.plot=false",
    ]
    recipe = pipeline.load_recipe(QUICKSTART, overrides)
    anyio.run(lambda: run_program(recipe, engine=FakeEngine(), trainer=FakeTrainer()))
    saved = run_dir / "checkpoints" / "step-000001"
    with (saved / "recipe.yaml").open("ab") as handle:
        handle.write(b"# caf\xe9\n")
    # Committed so (a marker without checksums, as before them): else the changed size says it first.
    lines = (saved / "COMMITTED").read_text().splitlines()
    (saved / "COMMITTED").write_text("".join(line.split("\t")[0] + "\n" for line in lines))
    assert check(QUICKSTART, *overrides, f"checkpoint.resume={saved}").startswith(
        f"checkpoint.resume: {saved} cannot be used: {saved / 'recipe.yaml'}: not UTF-8 text: "
        "byte 0xe9 at line "
    )
    # `inspect` reads it too: one line, no traceback.
    from stages.checkpoint import describe

    with pytest.raises(RecipeError) as inspected:
        describe(saved)
    assert str(inspected.value).startswith(
        f"{saved}: a damaged checkpoint: {saved / 'recipe.yaml'}: not UTF-8"
    )


def test_a_reward_that_does_not_import() -> None:
    assert check(QUICKSTART, "reward.function=no_such_module:score") == (
        "reward.function: cannot import module 'no_such_module': No module named 'no_such_module'"
    )


def test_a_resume_path_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    assert check(QUICKSTART, f"checkpoint.resume={tmp_path / 'nope'}") == (
        f"checkpoint.resume: {tmp_path / 'nope'} is not a committed checkpoint (no COMMITTED file)"
    )


def test_a_data_file_that_does_not_parse(tmp_path: Path) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n')
    source = f"prompts.source={{kind: jsonl, path: {data}}}"
    assert check(QUICKSTART, source, "eval.every_steps=0") == (f"{data}:2: not valid JSON: Expecting value")


@pytest.mark.skipif(not CPU_BUILD, reason="needs a CPU build of torch")
def test_cuda_on_a_cpu_build_of_torch() -> None:
    assert check(QUICKSTART, "model.device=cuda") == CPU_TORCH


@pytest.mark.skipif(not CPU_BUILD, reason="needs a CPU build of torch")
@pytest.mark.parametrize("command", ["validate", "run"])
def test_validate_and_run_exit_2_with_one_line_for_a_missing_device(tmp_path: Path, command: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            command,
            str(QUICKSTART),
            "model.device=cuda",
            f"run.dir={tmp_path}/r",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert (result.returncode, result.stderr) == (2, f"error: {CPU_TORCH}\n")
    # `run` says what start-up did before it found the device missing (stdout, with the
    # console's lines); `validate` says nothing but its verdict.
    said = [line.partition(" ")[2] for line in result.stdout.replace("\n    ", " ").splitlines()]
    assert said == (
        [] if command == "validate" else [f"starting a run of 200 steps in {tmp_path}/r", "loading torch"]
    )
    assert not (tmp_path / "r").exists()


def test_ray_placement_needs_ray_and_leaves_the_device_to_the_actors(monkeypatch: pytest.MonkeyPatch) -> None:
    # The controller of a GPU cluster may be a CPU machine: its own torch decides nothing.
    preflight(pipeline.load_recipe(QUICKSTART, ["placement.backend=ray", "model.device=cuda"]))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *rest: None if name == "ray" else real(name, *rest)
    )
    assert check(QUICKSTART, "placement.backend=ray") == (
        "placement.backend: ray needs the ray package: pip install 'ray>=2.60' "
        "(or this project's extra: pip install -e '.[ray]')"
    )


@pytest.mark.parametrize(
    ("package", "override", "message"),
    [
        ("wandb", "wandb.enabled=true", "wandb.enabled: wandb is not installed (pip install wandb)"),
        (
            "tensorboard",
            "tensorboard.enabled=true",
            "tensorboard.enabled: the tensorboard package is not installed (pip install tensorboard)",
        ),
    ],
)
def test_a_sink_whose_package_is_missing_is_refused_before_the_run(
    monkeypatch: pytest.MonkeyPatch, package: str, override: str, message: str
) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # find_spec now finds nothing
    assert check(QUICKSTART, override) == message
