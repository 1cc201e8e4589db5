"""Recipes: every shipped one loads; bad ones fail with one exact, actionable message."""

from __future__ import annotations

from pathlib import Path

import pytest

import pipeline
from pipeline.contracts.errors import RecipeError
from pipeline.shell.recipe import Recipe

RECIPES = sorted((Path(__file__).parents[3] / "recipes").glob("*.yaml"))


def test_there_are_recipes() -> None:
    assert RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_recipe_loads(path: Path) -> None:
    recipe = pipeline.load_recipe(path)
    assert isinstance(recipe, Recipe)


def test_the_recipes_with_figures_in_the_readme_carry_gates() -> None:
    gated = {path.name for path in RECIPES if pipeline.load_recipe(path).gates.checks}
    assert gated == {
        "quickstart.yaml",
        "multi-turn-cpu.yaml",
        "reverse-digits.yaml",
        "bench-h200-colocated.yaml",
        "bench-h200-separate.yaml",
        "bench-h200-8b-offload.yaml",
        "bench-h200-long-tail.yaml",
        "gpu-reverse-16.yaml",
        "multi-turn-gpu.yaml",
    }


# rollout.engine megatron where it can run (the device is checked by `validate` and `run`).
MEGATRON_ON_GPU = (
    "train:\n  backend: megatron\nmodel:\n  device: cuda\n  dtype: bfloat16\n  config: {vocab_size: 16}\n"
    "rollout:\n  engine: megatron\n"
)

VALID_RUN_FIELDS = "dir, steps, seed, stop_grace_s, progress, log_every_steps, plot"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param(
            "run:\n  stepz: 3\n",
            f"run.stepz: unknown field (did you mean `steps`?); valid fields: {VALID_RUN_FIELDS}",
            id="unknown-key",
        ),
        pytest.param(
            "colour: blue\n",
            "colour: unknown field; valid fields: run, async_rl, colocated, placement, checkpoint, watchdog, "
            "wandb, tensorboard, model, prompts, rollout, reward, train, eval, faults, gates",
            id="unknown-section",
        ),
        pytest.param(
            "run:\n  steps: three\n", "run.steps: Expected `int`, got `str` ('three')", id="wrong-type"
        ),
        pytest.param("run: 3\n", "run: Expected `object`, got `int` (3)", id="section-not-a-mapping"),
        pytest.param(
            "async_rl:\n  max_lookahead_versions: -1\n",
            "async_rl.max_lookahead_versions: Expected `int` >= 0, got -1",
            id="negative-lookahead",
        ),
        pytest.param(
            "checkpoint:\n  keep_last: 1\n",
            "checkpoint.keep_last: Expected `int` >= 2, got 1",
            id="keep-last",
        ),
        pytest.param(
            "rollout:\n  top_p: 1.5\n", "rollout.top_p: Expected `float` <= 1.0, got 1.5", id="top-p"
        ),
        pytest.param(
            "train:\n  lr: 1e-5\n",
            "train.lr: Expected `float`, got `str` ('1e-5'): YAML reads 1e-5 as a string, write 1.0e-5",
            id="lr-read-as-string",
        ),
        pytest.param(
            "train:\n  schedule: linear\n",
            "train.schedule: Invalid enum value 'linear'; expected one of: constant, cosine",
            id="bad-literal",
        ),
        pytest.param(
            "train:\n  backend: jax\n",
            "train.backend: Invalid enum value 'jax'; expected one of: megatron, torch",
            id="unknown-backend",
        ),
        pytest.param(
            "prompts:\n  source:\n    kind: csv\n",
            "prompts.source.kind: Invalid value 'csv'; expected one of: "
            "jsonl, parquet, reasoning_gym, synthetic",
            id="union-unknown-kind",
        ),
        pytest.param(
            "prompts:\n  source:\n    kind: jsonl\n",
            "prompts.source.path: required field is missing",
            id="union-missing-field",
        ),
        pytest.param(
            "prompts:\n  source:\n    kind: synthetic\n    min_digits: 6\n    max_digits: 5\n",
            "prompts.source: min_digits (6) must be <= max_digits (5)",
            id="cross-field",
        ),
        pytest.param(
            "colocated: false\nrollout:\n  partial: true\n",
            "rollout.partial: true needs colocated: true (a separate engine never stands down, so "
            "nothing would freeze); set rollout.partial: false",
            id="partial-rollouts-separate",
        ),
        pytest.param(
            "rollout:\n  episode_kv_gb: -1\n",
            "rollout.episode_kv_gb: Expected `float` >= 0.0, got -1",
            id="episode-kv-negative",
        ),
        pytest.param(
            "rollout:\n  bench_lengths: {median_tokens: 256, sigma: 0}\n",
            "rollout.bench_lengths.sigma: Expected `float` > 0.0, got 0",
            id="bench-lengths-sigma",
        ),
        pytest.param(
            "prompts:\n  system_prompt: Be brief.\n",
            "prompts: system_prompt needs chat_template: true",
            id="system-prompt-without-chat-template",
        ),
        pytest.param(
            "gates:\n  checks:\n    - {metric: train/token_mult_prob_eror, stat: median, lt: 1.1}\n",
            "gates.checks[0]: unknown metric `train/token_mult_prob_eror` (did you mean "
            "`train/token_mult_prob_error`?); the names a run logs are listed in README.md, 'Watching a run'",
            id="gate-unknown-metric",
        ),
        pytest.param(
            "gates:\n  checks:\n    - {metric: reward/mean, stat: last, gt: 0}\n"
            "    - {metric: loss, stat: last, lt: 1}\n",
            "gates.checks[1]: unknown metric `loss`; the names a run logs are listed in README.md, "
            "'Watching a run'",
            id="gate-unknown-metric-second",
        ),
        pytest.param(
            "async_rl:\n  max_lookahead_versions: 0\n"
            "gates:\n  checks:\n    - {metric: rollout/lag_hist/1, stat: max, le: 0}\n",
            "gates.checks[0]: unknown metric `rollout/lag_hist/1` (did you mean `rollout/lag_hist/0`?); "
            "the names a run logs are listed in README.md, 'Watching a run'",
            id="gate-lag-hist-beyond-lookahead",
        ),
        pytest.param(
            "gates:\n  checks:\n    - {metric: eval/has_answer, stat: last, gt: 0.5}\n",
            "gates.checks[0]: unknown metric `eval/has_answer`; the names a run logs are listed in "
            "README.md, 'Watching a run'",
            id="gate-info-key-the-builtin-reward-has-not",
        ),
        pytest.param(
            "gates:\n  checks:\n    - {metric: reward/mean, stat: last}\n",
            "gates.checks[0]: reward/mean: give exactly one bound (lt, le, gt or ge), got none",
            id="gate-no-bound",
        ),
        pytest.param(
            "gates:\n  checks:\n    - {metric: reward/mean, stat: last, gt: 0.1, lt: 0.9}\n",
            "gates.checks[0]: reward/mean: give exactly one bound (lt, le, gt or ge), got lt, gt",
            id="gate-two-bounds",
        ),
        pytest.param(
            "gates:\n  checks:\n    - {metric: reward/mean, stat: at, gt: 0.2}\n",
            "gates.checks[0]: reward/mean: stat: at needs the step to read (step: N)",
            id="gate-at-without-step",
        ),
        pytest.param(
            "gates:\n  checks:\n    - {metric: reward/mean, stat: max, step: 5, gt: 0.2}\n",
            "gates.checks[0]: reward/mean: step is for stat: at; a range is first_step/last_step",
            id="gate-step-without-at",
        ),
        pytest.param(
            "gates:\n  checks:\n    - {metric: reward/mean, stat: at, step: 5, first_step: 2, gt: 0.2}\n",
            "gates.checks[0]: reward/mean: stat: at takes one step, not first_step/last_step",
            id="gate-at-with-range",
        ),
        pytest.param(
            "gates:\n  checks:\n    - {metric: reward/mean, stat: max, first_step: 9, last_step: 3, gt: 0}\n",
            "gates.checks[0]: reward/mean: first_step (9) must be <= last_step (3)",
            id="gate-empty-range",
        ),
        pytest.param(
            "gates:\n  checks:\n    - {metric: eval/reward, stat: last, healthy_only: true, gt: 0}\n",
            "gates.checks[0]: eval/reward: healthy_only selects train steps, not evaluations",
            id="gate-healthy-evaluations",
        ),
        pytest.param(
            "gates:\n  checks:\n    - {metric: reward/mean, stat: p95, gt: 0}\n",
            "gates.checks[0].stat: Invalid enum value 'p95'; expected one of: "
            "at, last, max, mean, median, min",
            id="gate-unknown-statistic",
        ),
        pytest.param(
            "gates:\n  checks:\n    - {metric: train/gen_kl_error, stat: max, lt: 1e-3}\n",
            "gates.checks[0].lt: Expected `float | null`, got `str` ('1e-3'): YAML reads 1e-3 as a string, "
            "write 1.0e-3",
            id="gate-bound-read-as-string",
        ),
        pytest.param(
            "gates:\n  checks:\n    - {metric: reward/mean, stats: max, gt: 0}\n",
            "gates.checks[0].stats: unknown field (did you mean `stat`?); valid fields: metric, stat, step, "
            "first_step, last_step, healthy_only, lt, le, gt, ge",
            id="gate-unknown-field",
        ),
        pytest.param(
            "gates:\n  checks:\n    - {stat: max, gt: 0}\n",
            "gates.checks[0].metric: required field is missing",
            id="gate-without-metric",
        ),
        pytest.param(
            "gates:\n  fail: maybe\n",
            "gates.fail: Expected `bool`, got `str` ('maybe')",
            id="gates-fail-not-a-bool",
        ),
        pytest.param(
            "placement:\n  backend: cloud\n",
            "placement.backend: Invalid value 'cloud'; expected one of: local, ray",
            id="placement-unknown-backend",
        ),
        pytest.param(
            "placement:\n  engines: 2\n",
            "placement.backend: required field is missing",
            id="placement-without-backend",
        ),
        pytest.param(
            "placement:\n  backend: ray\n  engines: 2\n",
            "placement.engines: 2 needs colocated: false (colocated, the one engine shares the "
            "trainer's actor and weights)",
            id="placement-replicas-colocated",
        ),
        pytest.param(
            "placement:\n  backend: ray\nrollout:\n  partial: true\n",
            "rollout.partial: true is not built for placement.backend ray yet (an engine actor does "
            "not freeze its rows at a stand-down): set rollout.partial: false or placement.backend: local",
            id="placement-ray-partial",
        ),
        pytest.param(
            "placement:\n  backend: ray\n  reward_workers: 2\nreward:\n  function: reasoning_gym\n",
            "placement.reward_workers: reward.function 'reasoning_gym' checks answers with the prompt "
            "source's own objects, which stay in the controller: set placement.reward_workers: 0",
            id="placement-reward-workers-reasoning-gym",
        ),
        pytest.param(
            "placement:\n  backend: ray\n  environment_workers: 2\n",
            "placement.environment_workers: 2 needs rollout.environment (module:Class): a single-turn "
            "run has no environments to run; set placement.environment_workers: 0",
            id="placement-environment-workers-single-turn",
        ),
        pytest.param(
            "colocated: false\nmodel:\n  device: cuda\n  config: {vocab_size: 16}\n"
            "placement:\n  backend: ray\n  engine_gpus: 0\n",
            "placement.engine_gpus: 0, but model.device: cuda: Ray shows an actor only the GPUs it asks "
            "for; leave it unset (a GPU of its own) or set 0.5 for the engine and the trainer each (the "
            "two share one GPU)",
            id="placement-cuda-without-gpus",
        ),
        pytest.param(
            "colocated: false\nplacement:\n  backend: ray\n  weights: cuda_ipc\n",
            "placement.weights: cuda_ipc needs one engine and the trainer on one GPU (placement.engines: 1, "
            "model.device: cuda, engine_gpus + trainer_gpus <= 1): set placement.weights: auto",
            id="placement-cuda-ipc-without-a-shared-gpu",
        ),
        pytest.param(
            "placement:\n  backend: ray\n  weights: collective\n",
            "placement.weights: collective needs colocated: false (colocated, the engine shares the "
            "trainer's weights): set placement.weights: auto",
            id="placement-weights-colocated",
        ),
        pytest.param(
            "colocated: false\nmodel:\n  device: cuda\n  config: {vocab_size: 16}\n"
            "placement:\n  backend: ray\n  weights: collective\n  engine_gpus: 0.5\n  trainer_gpus: 0.5\n",
            "placement.weights: collective, but placement.trainer_gpus: 0.5: NCCL takes one rank per GPU, "
            "so each actor needs a GPU of its own: leave placement.trainer_gpus unset, or set "
            "placement.weights: auto",
            id="placement-collective-on-a-shared-gpu",
        ),
        pytest.param(
            "rollout:\n  kv_cache_gb: 4\n",
            "rollout.kv_cache_gb: 4 sizes the KV cache of rollout.engine megatron; the torch engine sizes "
            "its own for each decode loop: leave it at 0",
            id="kv-cache-gb-for-the-torch-engine",
        ),
        pytest.param(
            "rollout:\n  graphs: true\n",
            "rollout.graphs: true turns on the CUDA graphs of rollout.engine megatron; the torch engine "
            "always replays its decode steps from graphs on CUDA: leave it at false",
            id="graphs-for-the-torch-engine",
        ),
        pytest.param(
            "rollout:\n  engine: megatron\n",
            "rollout.engine: megatron needs train.backend: megatron (it serves the megatron trainer's own "
            "model), got torch; set train.backend: megatron or rollout.engine: torch",
            id="megatron-engine-torch-trainer",
        ),
        pytest.param(
            "train:\n  backend: megatron\nrollout:\n  engine: megatron\n",
            "rollout.engine: megatron needs model.device: cuda (megatron's dynamic inference context "
            "allocates its KV cache and bookkeeping on CUDA only), got cpu; set rollout.engine: torch",
            id="megatron-engine-on-cpu",
        ),
        pytest.param(
            "train:\n  backend: megatron\nmodel:\n  device: cuda\n  config: {vocab_size: 16}\n"
            "rollout:\n  engine: megatron\n",
            "rollout.engine: megatron needs model.dtype: bfloat16 (its attention runs flash-attention "
            "kernels, which take bf16), got float32",
            id="megatron-engine-float32",
        ),
        pytest.param(
            MEGATRON_ON_GPU.replace("backend: megatron", "backend: megatron\n  tensor_parallel: 2")
            + "placement:\n  backend: ray\n",
            "rollout.engine: megatron is not built for train.tensor_parallel: 2 yet (it would run one "
            "rank's shard of the model, whose forward needs every rank); set train.tensor_parallel: 1 "
            "or rollout.engine: torch",
            id="megatron-engine-tensor-parallel",
        ),
        pytest.param(
            MEGATRON_ON_GPU.replace("engine: megatron", "engine: megatron\n  partial: true\n  graphs: true"),
            "rollout.partial: true with rollout.engine megatron needs rollout.graphs: false (graphs keep "
            "megatron's KV cache across a stand-down, so a frozen request would hold it through the train "
            "step and continue over keys of the old weights; without graphs it is recomputed under the "
            "new ones); set rollout.graphs: false or rollout.partial: false",
            id="megatron-engine-partial-graphs",
        ),
        pytest.param(
            "rollout:\n  attention: flash-attn-4\n",
            "rollout.attention: flash-attn-4 picks the attention kernels of rollout.engine megatron; the "
            "torch engine runs its own: leave it at adapter",
            id="attention-for-the-torch-engine",
        ),
        pytest.param(
            MEGATRON_ON_GPU.replace("engine: megatron", "engine: megatron\n  attention: flash-attn-4"),
            "rollout.attention: flash-attn-4 needs the flash-attn-4 package, 4.0.0b20 or later (it is not "
            "installed); `pip install flash-attn-4`, or set rollout.attention: adapter",
            id="megatron-engine-flash-attn-4-missing",
        ),
        pytest.param("train:\n  lr: .inf\n", "train.lr: Expected a finite number, got inf", id="lr-infinite"),
        pytest.param(
            "rollout:\n  temperature: .nan\n",
            "rollout.temperature: Expected a finite number, got nan",
            id="temperature-nan",
        ),
        pytest.param(
            "gates:\n  checks:\n    - {metric: reward/mean, stat: max, lt: -.inf}\n",
            "gates.checks[0].lt: Expected a finite number, got -inf",
            id="gate-bound-infinite",
        ),
        pytest.param(
            "run:\n  dir: runs/caf\udcff\n",
            "not UTF-8 text: byte 0xff at line 2, column 16; save it as UTF-8",
            id="not-utf8",
        ),
        pytest.param(
            "prompts:\n  source:\n    kind: synthetic\n    min_digits: 1\n    max_digits: 1\n",
            "prompts.source: num_heldout (256) must be below the 10 distinct prompts of 1-1 digits "
            "(the others are trained on)",
            id="heldout-more-than-the-task-has",
        ),
        pytest.param(
            "prompts:\n  source:\n    kind: synthetic\n    max_digits: 12\n    num_heldout: 1000000000000\n",
            "prompts.source: num_heldout (1000000000000) must be at most 100000 (held-out prompts are "
            "made up front and kept in memory)",
            id="heldout-huge",
        ),
        pytest.param(
            "rollout:\n  environment_args: {high: 3}\n",
            "rollout: environment_args: given without rollout.environment (module:Class)",
            id="environment-args-alone",
        ),
        pytest.param(
            "rollout:\n  environment: a:B\n  max_new_tokens: 8\n  max_episode_tokens: 4\n",
            "rollout: max_new_tokens (8) must be <= max_episode_tokens (4): no turn would fit in an episode",
            id="episode-budget-below-a-turn",
        ),
        pytest.param(
            "rollout:\n  observation_role: system\n",
            "rollout.observation_role: Invalid enum value 'system'; expected one of: tool, user",
            id="observation-role",
        ),
        pytest.param(
            "placement:\n  backend: ray\n  weights: nccl\n",
            "placement.weights: Invalid enum value 'nccl'; expected one of: auto, collective, cuda_ipc, "
            "object_store",
            id="placement-weights-unknown",
        ),
        pytest.param(
            "train:\n  data_parallel: 2\n",
            "train.data_parallel: 2 needs placement.backend: ray (a pipeline process is one rank: Ray "
            "starts one trainer actor a rank)",
            id="data-parallel-in-one-process",
        ),
        pytest.param(
            "model:\n  config: {vocab_size: 16}\n  device: cuda\nplacement:\n  backend: ray\n"
            "  trainer_gpus: 0.5\ntrain:\n  data_parallel: 2\n",
            "train.data_parallel: 2 with placement.trainer_gpus: 0.5: NCCL takes one rank per GPU, so "
            "each trainer rank needs a GPU of its own: leave placement.trainer_gpus unset",
            id="data-parallel-ranks-sharing-a-gpu",
        ),
    ],
)
def test_bad_recipe_message(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))  # "\udcff": the byte 0xff
    with pytest.raises(RecipeError) as raised:
        pipeline.load_recipe(path)
    assert str(raised.value) == f"{path}: {message}"


@pytest.mark.parametrize("colocated", ["true", "false"])
def test_megatrons_engine_on_ray_is_a_valid_recipe(tmp_path: Path, colocated: str) -> None:
    """Colocated in the trainer rank's actor, or apart as engine replicas (tensor parallel 1)."""
    path = tmp_path / "ray.yaml"
    path.write_text(MEGATRON_ON_GPU + f"placement:\n  backend: ray\ncolocated: {colocated}\n")
    recipe = pipeline.load_recipe(path)
    assert recipe.rollout.engine == "megatron" and type(recipe.placement).__name__ == "RayPlacement"


def test_yaml_syntax_error_names_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("run:\n  steps: 3\n   seed: 1\n")
    with pytest.raises(RecipeError) as raised:
        pipeline.load_recipe(path)
    assert str(raised.value) == f"{path}: invalid YAML: line 3, column 8: mapping values are not allowed here"


def test_recipe_that_is_not_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("- run\n- steps\n")
    with pytest.raises(RecipeError) as raised:
        pipeline.load_recipe(path)
    assert str(raised.value) == f"{path}: a recipe must be a mapping of sections, got list"


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(RecipeError) as raised:
        pipeline.load_recipe(path)
    assert str(raised.value) == f"{path}: recipe file not found"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        pytest.param(
            "run.steps", "override 'run.steps': expected key.path=value, e.g. run.steps=20", id="no-equals"
        ),
        pytest.param("=3", "override '=3': expected key.path=value, e.g. run.steps=20", id="no-key"),
        pytest.param(
            "run..steps=3",
            "override 'run..steps=3': expected key.path=value, e.g. run.steps=20",
            id="empty-part",
        ),
        pytest.param(
            "run.steps.x=3", "override 'run.steps.x=3': steps in {path} is not a section", id="into-a-value"
        ),
        pytest.param(
            "run.stepz=3",
            "{path}: override 'run.stepz=3': run.stepz: unknown field (did you mean `steps`?); "
            f"valid fields: {VALID_RUN_FIELDS}",
            id="unknown-key",
        ),
        pytest.param(
            "nosuch.x=1",
            "{path}: override 'nosuch.x=1': nosuch: unknown field; valid fields: run, async_rl, colocated, "
            "placement, checkpoint, watchdog, wandb, tensorboard, model, prompts, rollout, reward, train, "
            "eval, faults, gates",
            id="unknown-section",
        ),
        pytest.param(
            "train.lr=1e-5",
            "{path}: override 'train.lr=1e-5': train.lr: Expected `float`, got `str` ('1e-5'): "
            "YAML reads 1e-5 as a string, write 1.0e-5",
            id="lr-read-as-string",
        ),
        pytest.param(
            "rollout.generation_s=1.0e3",
            "{path}: override 'rollout.generation_s=1.0e3': rollout.generation_s: Expected `float`, got "
            "`str` ('1.0e3'): YAML reads 1.0e3 as a string, write 1.0e+3",
            id="unsigned-exponent-read-as-string",
        ),
        pytest.param(
            "run.dir=runs/\udcff",  # the byte 0xff on a command line, as Python keeps it
            "override 'run.dir=runs/\\udcff': not UTF-8 text: byte 0xff at column 14",
            id="not-utf8",
        ),
        pytest.param(
            "run.steps=0",
            "{path}: override 'run.steps=0': run.steps: Expected `int` >= 1, got 0",
            id="out-of-range",
        ),
    ],
)
def test_bad_override_message(tmp_path: Path, override: str, message: str) -> None:
    path = tmp_path / "good.yaml"
    path.write_text("run:\n  steps: 3\n")
    with pytest.raises(RecipeError) as raised:
        pipeline.load_recipe(path, [override])
    assert str(raised.value) == message.format(path=path)


def test_overrides_are_applied_as_yaml_values(tmp_path: Path) -> None:
    path = tmp_path / "good.yaml"
    path.write_text("run:\n  steps: 3\n")
    recipe = pipeline.load_recipe(
        path, ["run.steps=7", "train.lr=2.0e-5", "async_rl.max_lookahead_versions=0"]
    )
    assert (recipe.run.steps, recipe.train.lr, recipe.async_rl.max_lookahead_versions) == (7, 2.0e-5, 0)


def test_evaluation_without_held_out_prompts_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text("prompts:\n  source:\n    kind: jsonl\n    path: data.jsonl\neval:\n  every_steps: 5\n")
    with pytest.raises(RecipeError) as error:
        pipeline.load_recipe(path)
    assert str(error.value) == (
        f"{path}: eval.every_steps needs held-out prompts: set prompts.source.num_heldout > 0 "
        "or eval.every_steps: 0"
    )


def test_gates_accept_the_names_the_recipe_makes(tmp_path: Path) -> None:
    # The lag histogram up to L; a module:function reward's info keys are known only once it runs.
    path = tmp_path / "recipe.yaml"
    path.write_text(
        "async_rl:\n  max_lookahead_versions: 2\nreward:\n  function: mypkg.rewards:score\n"
        "gates:\n  checks:\n"
        "    - {metric: rollout/lag_hist/2, stat: max, le: 1}\n"
        "    - {metric: reward/format_ok, stat: last, gt: 0.5}\n"
        "    - {metric: eval/format_ok, stat: last, gt: 0.5}\n"
        "    - {metric: train/kl_ref, stat: max, lt: 0.1}\n"
        "    - {metric: timing/eval_s, stat: max, lt: 60}\n"
    )
    assert len(pipeline.load_recipe(path).gates.checks) == 5
    with pytest.raises(RecipeError) as raised:
        pipeline.load_recipe(path, ["gates.checks=[{metric: reward/a/b, stat: last, gt: 0}]"])
    assert str(raised.value) == (
        f"{path}: gates.checks[0]: unknown metric `reward/a/b` (did you mean `reward/mean`?); the names "
        "a run logs are listed in README.md, 'Watching a run'"
    )


def test_megatron_inference_loads_where_it_can_run(tmp_path: Path) -> None:
    path = tmp_path / "megatron.yaml"
    path.write_text(MEGATRON_ON_GPU + "  kv_cache_gb: 2.5\n  bench_lengths: {median_tokens: 4}\n")
    rollout = pipeline.load_recipe(path).rollout
    assert (rollout.engine, rollout.kv_cache_gb) == ("megatron", 2.5)
    # Greedy rollouts, a top-p cut and graphs too (their logprobs: tests/backends/test_megatron_serve.py).
    path.write_text(MEGATRON_ON_GPU + "  temperature: 0\n  top_p: 0.9\n  graphs: true\n")
    rollout = pipeline.load_recipe(path).rollout
    assert (rollout.temperature, rollout.top_p, rollout.graphs) == (0, 0.9, True)
    # Apart from the trainer, and with partial rollouts (colocated, without graphs).
    path.write_text(MEGATRON_ON_GPU + "colocated: false\n")
    assert not pipeline.load_recipe(path).colocated
    path.write_text(MEGATRON_ON_GPU + "  partial: true\n")
    assert pipeline.load_recipe(path).rollout.partial


def test_a_lookahead_past_the_run_sizes_nothing_past_the_run(tmp_path: Path) -> None:
    """L above run.steps admits no more batches than the run has: the lag histogram's names stop
    at run.steps (L = 10**12 made `validate` enumerate names without bound)."""
    from pipeline.shell.metric_names import MetricNames

    path = tmp_path / "recipe.yaml"
    path.write_text("run:\n  steps: 3\nasync_rl:\n  max_lookahead_versions: 1000000\n")
    names = MetricNames.for_recipe(pipeline.load_recipe(path)).steps
    assert sorted(n for n in names if n.startswith("rollout/lag_hist/")) == [
        f"rollout/lag_hist/{k}" for k in range(4)
    ]
