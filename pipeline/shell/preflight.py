"""The checks a recipe must pass before any weights are read, shared by `validate` and `run`.

`preflight` raises `RecipeError` for what would otherwise fail later in the run (or, for the
model and device, with a traceback): a resume path that is not a checkpoint or a recipe that
does not match it, a missing model directory or config.json, a device this machine lacks, data
files that do not parse, a reward function that does not import, a chat template that cannot
continue an episode token-exactly (`stages.chat_turns`), an RL algorithm whose parts do not resolve or
combine, the packages of the enabled metric sinks (wandb, tensorboard), Ray missing where the recipe
places the backend on it, what the chosen backend refuses (`backends.registry.check`), and
prompts plus `rollout.max_new_tokens` past the model's positions (a learned table, or a rotary
model's `max_position_embeddings`), and on a CPU, the model's weights and the engine's KV cache for
the rows it generates at once against the machine's memory. What it built on the way (the resume
prompts, the reward function) is what `run` goes on with.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from backends import registry
from backends.placement import RayPlacement, check_ray
from backends.torch.config import ModelConfig
from pipeline.algorithms.config import Algorithm
from pipeline.algorithms.presets import algorithm_of
from pipeline.contracts.errors import RecipeError
from pipeline.environments import EnvironmentFactory
from pipeline.environments import resolve as resolve_environment
from pipeline.rewards.scoring import RewardFn, resolve
from pipeline.shell.backend_input import backend_input
from pipeline.shell.recipe import Recipe
from pipeline.sinks import check_installed
from stages.chat_turns import chat_turns
from stages.checkpoint import open_resume
from stages.prompts import PromptSet, SyntheticSource, build_prompts


@dataclass(frozen=True)
class Checked:
    prompts: PromptSet
    reward_fn: RewardFn
    algorithm: Algorithm
    environment: EnvironmentFactory | None = None  # rollout.environment's, one per episode


def preflight(recipe: Recipe, *, model: bool = True, resume: bool = True) -> Checked:
    """Every check that needs no weights; `model=False` skips the model's (a caller that brings
    its own engine and trainer has none to check), `resume=False` the resume checkpoint's (`run`
    loads and verifies it whole). Imports torch when `model`."""
    if resume:
        _check_resume(recipe)
    check_installed(wandb=recipe.wandb.enabled, tensorboard=recipe.tensorboard.enabled)
    if model:
        from backends.torch.runtime import load

        load()  # before the algorithm's losses import torch: it sets how torch's threads wait
    algorithm = algorithm_of(recipe)  # the algorithm's parts resolve (a custom one imports) and combine
    if model:
        # The backend's own refusals (megatron's unsupported train fields), on the one input it
        # is built from.
        registry.check(backend_input(recipe, algorithm))
    limit = _check_model(recipe) if model else None
    source = recipe.prompts.source
    if limit is not None and isinstance(source, SyntheticSource) and source.max_digits > limit.positions:
        # Before the prompts are built: their strings are as long as the recipe says.
        raise RecipeError(
            f"prompts.source.max_digits: {source.max_digits} digits cannot fit "
            f"model.config.max_position_embeddings {limit.positions} ({limit.why})"
        )
    prompts = build_prompts(recipe.prompts, recipe.run.seed, model_path=recipe.model.path)
    reward_fn = resolve(recipe.reward.function, source_reward=prompts.reward)
    if limit is not None and prompts.longest + recipe.rollout.max_new_tokens > limit.positions:
        raise RecipeError(
            f"rollout.max_new_tokens: {recipe.rollout.max_new_tokens} new tokens after the longest "
            f"prompt ({prompts.longest} tokens) exceed model.config.max_position_embeddings "
            f"{limit.positions} ({limit.why}); set it to at most {max(limit.positions - prompts.longest, 0)}"
        )
    if limit is not None and limit.kv_bytes is not None:
        rollout = recipe.rollout  # an episode's row holds its turns' and observations' tokens
        after = rollout.max_episode_tokens if rollout.environment is not None else rollout.max_new_tokens
        _check_rows_fit(recipe, prompts.longest + after, limit.kv_bytes)
    environment = None
    if recipe.rollout.environment is not None:
        environment = resolve_environment(recipe.rollout.environment, recipe.rollout.environment_args)
        chat_turns(recipe.prompts, recipe.rollout, prompts.tokenizer)  # refuses a template it cannot continue
        if limit is not None and prompts.longest + recipe.rollout.max_episode_tokens > limit.positions:
            raise RecipeError(
                f"rollout.max_episode_tokens: {recipe.rollout.max_episode_tokens} tokens after the "
                f"longest prompt ({prompts.longest} tokens) exceed model.config.max_position_embeddings "
                f"{limit.positions} ({limit.why}); set it to at most "
                f"{max(limit.positions - prompts.longest, 0)}"
            )
    return Checked(prompts, reward_fn, algorithm, environment)


@dataclass(frozen=True)
class _Positions:
    positions: int  # the most positions a sequence may use: prompt and new tokens
    why: str
    kv_bytes: int | None = None  # what one position of one row takes in the engine's KV cache (CPU)


def _positions(config: ModelConfig) -> _Positions:
    """A learned position table holds no more; a rotary model's context, which sizes its KV
    cache, is as far as it was built for (past it a run would size caches by the recipe alone)."""
    if config.position_limit is not None:
        return _Positions(config.position_limit, "learned position embeddings")
    return _Positions(config.max_position_embeddings, "the context the model is built for")


def _memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check_resume(recipe: Recipe) -> None:
    """The checkpoint a run would resume from, against this recipe, read without its weights."""
    if recipe.checkpoint.resume != "never":  # whether run.dir is empty is the run's to say
        open_resume(Path(recipe.run.dir), recipe)


def _check_model(recipe: Recipe) -> _Positions:
    """How many positions the model holds, after checking that its files and device are there."""
    from backends.torch.runtime import load

    load()  # first: it sets how torch's threads wait, which torch reads once, as it loads
    from backends.torch.device import check_device
    from backends.torch.errors import ModelLoadError
    from backends.torch.hf import read_config

    section = recipe.model
    if section.path is None:
        assert section.config is not None  # the section holds exactly one of the two
        config = section.config
    else:
        path = Path(section.path)
        if not path.is_dir():
            raise RecipeError(
                f"model.path: {path}: no such directory; fetch the model into it first, e.g. "
                f"huggingface-cli download ORG/NAME --local-dir {path}"
            )
        try:
            config = read_config(path)
        except ModelLoadError as error:
            raise RecipeError(f"model.path: {error}") from None
    if isinstance(recipe.placement, RayPlacement):
        check_ray()  # the device is the actors' to check, on the nodes they run on
    else:
        check_device(section.device, "model.device")
        if section.device == "cpu":
            itemsize = 4 if section.dtype == "float32" else 2
            field = "model.path" if section.path else "model.config"
            _check_weights_fit(config, itemsize, f"{section.dtype} weights", field)
            kv_heads = 2 * config.num_key_value_heads  # keys and values
            kv_bytes = config.num_hidden_layers * kv_heads * (config.head_dim or 0) * itemsize
            return dataclasses.replace(_positions(config), kv_bytes=kv_bytes)
    return _positions(config)


def _check_rows_fit(recipe: Recipe, positions: int, kv_bytes: int) -> None:
    """The rows the engine generates at once, each caching `positions` positions, must fit this
    machine's memory (a trillion prompts or samples a step, or `rollout.max_rows`, asked the
    allocator for petabytes, or filled memory for minutes while the SIGTERM of a stop waited)."""
    rollout = recipe.rollout
    if rollout.max_rows:
        rows, asked = rollout.max_rows, f"rollout.max_rows: {rollout.max_rows} rows"
    else:  # the step's rows; at L >= 1 the next batch's beside them
        batches = 2 if recipe.async_rl.max_lookahead_versions else 1
        rows = recipe.prompts.prompts_per_step * rollout.samples_per_prompt * batches
        asked = (
            f"prompts.prompts_per_step x rollout.samples_per_prompt: {rows} rows "
            f"({'two batches at L >= 1' if batches == 2 else 'one batch'})"
        )
    needed, memory = rows * positions * kv_bytes, _memory()
    if needed > memory:
        raise RecipeError(
            f"{asked} of {positions} positions need {needed / 2**30:.3g} GiB of KV cache, more "
            f"than this machine's {memory / 2**30:.3g} GiB of memory"
        )


def _check_weights_fit(config: ModelConfig, itemsize: int, weights: str, field: str) -> None:
    """A model whose weights alone outgrow this machine's memory is refused before it is built
    (building it asked the allocator for terabytes, and the run ended in its traceback)."""
    hidden, head_dim = config.hidden_size, config.head_dim or 0
    attention = hidden * head_dim * 2 * (config.num_attention_heads + config.num_key_value_heads)
    layer = attention + 3 * hidden * config.intermediate_size
    tables = config.vocab_size * (1 if config.tie_word_embeddings else 2)
    if config.learned_position_embeddings:
        tables += config.max_position_embeddings
    parameters = config.num_hidden_layers * layer + tables * hidden  # norms and biases left out
    needed = parameters * itemsize
    memory = _memory()
    if needed > memory:
        raise RecipeError(
            f"{field}: a model of {parameters:.3g} parameters needs {needed / 2**30:.3g} GiB for its "
            f"{weights} alone, more than this machine's {memory / 2**30:.3g} GiB of memory"
        )
