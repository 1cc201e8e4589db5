"""Builds the one typed input a backend is built from (`pipeline.contracts.backend_input`),
once, from the whole recipe: the backends never see the recipe itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

from backends.input import Input
from backends.torch.runtime import load
from backends.torch.section import TrainerOptions
from pipeline.algorithms.config import Algorithm
from pipeline.algorithms.presets import algorithm_of
from pipeline.contracts.backend_input import Batching, Optimizer, Sampling

if TYPE_CHECKING:
    from pipeline.shell.recipe import Recipe


def sampling_of(recipe: Recipe) -> Sampling:
    """What an engine needs of the recipe's `rollout` (and the rows its batches admit)."""
    rollout = recipe.rollout
    admitted = min(recipe.async_rl.max_lookahead_versions + 1, recipe.run.steps)  # batches
    return Sampling(
        max_new_tokens=rollout.max_new_tokens,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        partial=rollout.partial,
        max_rows=rollout.max_rows,
        rows_admitted=recipe.prompts.prompts_per_step * rollout.samples_per_prompt * admitted,
        bench_lengths=rollout.bench_lengths,
        engine=rollout.engine,
        kv_cache_gb=rollout.kv_cache_gb,
        episode_kv_gb=rollout.episode_kv_gb,
        graphs=rollout.graphs,
        attention=rollout.attention,
    )


def options_of(recipe: Recipe) -> TrainerOptions:
    train = recipe.train
    return TrainerOptions(
        master_weights=train.master_weights,
        offload_optimizer=train.offload_optimizer,
        compile=train.compile,
        activation_checkpointing=train.activation_checkpointing,
        tensor_parallel=train.tensor_parallel,
        data_parallel=train.data_parallel,
    )


def backend_input(recipe: Recipe, algorithm: Algorithm | None = None) -> Input:
    """The backend's input for `recipe` (`algorithm`: its resolved one, where the caller has
    it; resolving raises `RecipeError` for an algorithm that does not resolve, and imports torch,
    which `runtime.load` brings up first)."""
    if algorithm is None:
        load()
        algorithm = algorithm_of(recipe)
    train = recipe.train
    return Input(
        backend=train.backend,
        model=recipe.model,
        sampling=sampling_of(recipe),
        optimizer=Optimizer(
            lr=train.lr,
            betas=(train.beta1, train.beta2),
            weight_decay=train.weight_decay,
            warmup_steps=train.warmup_steps,
            schedule=train.schedule,
            min_lr_ratio=train.min_lr_ratio,
            grad_clip=train.grad_clip,
            total_steps=recipe.run.steps,
        ),
        batching=Batching(
            micro_batch_samples=train.micro_batch_samples,
            micro_batch_tokens=train.micro_batch_tokens,
            updates_per_step=train.updates_per_step,
        ),
        algorithm=algorithm,
        seed=recipe.run.seed,
        colocated=recipe.colocated,
        handoff_checks=recipe.async_rl.handoff_checks,
        placement=recipe.placement,
        options=options_of(recipe),
        reward_function=recipe.reward.function,
        environment=recipe.rollout.environment,
        environment_args=recipe.rollout.environment_args,
    )
