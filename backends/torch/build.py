"""The torch backend (`train.backend: torch`): builds its engine and trainer for a recipe,
colocated (one model, one compute thread) or not."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from backends.bench_lengths import length_draw
from backends.torch.compute import ComputeThread
from backends.torch.engine import TorchEngine
from backends.torch.errors import ModelLoadError
from backends.torch.model import Decoder
from backends.torch.sampler import Sampler
from backends.torch.section import ModelSection
from backends.torch.trainer import TorchTrainer
from pipeline.algorithms.presets import algorithm_of
from pipeline.contracts.errors import RecipeError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check(recipe: Any) -> None:
    """Refuse, naming the field, what `train.backend: torch` does not do."""
    if recipe.train.tensor_parallel > 1:
        raise RecipeError(
            f"train.tensor_parallel: {recipe.train.tensor_parallel} needs train.backend: megatron "
            "(the torch trainer holds the whole model on one device)"
        )


def build_model(section: ModelSection, *, vocab_size: int, seed: int) -> Decoder:
    if section.threads:
        torch.set_num_threads(section.threads)
    if section.path is not None:
        from backends.torch.hf import load_pretrained

        try:
            _, model = load_pretrained(section.path, dtype=DTYPES[section.dtype], device=section.device)
        except ModelLoadError as error:  # a missing file or an unsupported model: the user's to fix
            raise RecipeError(f"model.path: {error}") from None
        field = "model.path"
    else:
        assert section.config is not None
        torch.manual_seed(seed)
        with torch.device(section.device):  # initialised where it runs: an 8B model in seconds
            model = Decoder(section.config).to(dtype=DTYPES[section.dtype])
        field = "model.config.vocab_size"
    if section.residual == "float32":
        model.residual_dtype = torch.float32
    if model.config.vocab_size < vocab_size:
        raise RecipeError(
            f"{field}: the model's vocabulary ({model.config.vocab_size}) is smaller than the "
            f"tokenizer's ({vocab_size})"
        )
    return model


def build_backend(
    recipe: Any, *, vocab_size: int, stop_ids: Sequence[int]
) -> tuple[TorchEngine, TorchTrainer]:
    """(engine, trainer) sharing one model when `recipe.colocated`, else two copies."""
    model = build_model(recipe.model, vocab_size=vocab_size, seed=recipe.run.seed)
    engine_model = model if recipe.colocated else copy.deepcopy(model)
    # Colocated, engine and trainer never run at once: one thread (one OpenMP team) for both.
    trainer_thread = ComputeThread("trainer")
    engine_thread = trainer_thread if recipe.colocated else ComputeThread("engine")
    engine = build_engine(
        recipe, engine_model, shared=recipe.colocated, source=model, stop_ids=stop_ids, compute=engine_thread
    )
    return engine, build_trainer(recipe, model, compute=trainer_thread)


def build_trainer_alone(recipe: Any, *, vocab_size: int) -> TorchTrainer:
    """The trainer alone, on a model of its own (a Ray trainer actor, whose engines are elsewhere)."""
    model = build_model(recipe.model, vocab_size=vocab_size, seed=recipe.run.seed)
    return build_trainer(recipe, model, compute=ComputeThread("trainer"))


def build_engine_alone(
    recipe: Any, *, vocab_size: int, stop_ids: Sequence[int], replica: int = 0
) -> TorchEngine:
    """Engine replica `replica` on a model of its own (a Ray engine actor, apart from the
    trainer), which `load_weights` refreshes."""
    model = build_model(recipe.model, vocab_size=vocab_size, seed=recipe.run.seed)
    return build_engine(
        recipe,
        model,
        shared=False,
        source=model,
        stop_ids=stop_ids,
        compute=ComputeThread("engine"),
        replica=replica,
    )


def build_engine(
    recipe: Any,
    model: Decoder,
    *,
    shared: bool,
    source: Decoder,
    stop_ids: Sequence[int],
    compute: ComputeThread,
    replica: int = 0,
) -> TorchEngine:
    """The engine sampling from `model`: the trainer's own when `shared` (colocated), else a
    copy that `refit` refreshes from `source`. Each replica of several samples its own draws."""
    rollout, train = recipe.rollout, recipe.train
    return TorchEngine(
        # Engine kernels round as the trainer's do (compiled or eager): closer logprobs.
        Sampler(model, graphs=recipe.model.cuda_graphs, eager_rounding=not train.compile),
        shared=shared,
        source=source,
        max_new_tokens=rollout.max_new_tokens,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        stop_token_ids=tuple(stop_ids),
        seed=recipe.run.seed + 1 + 1000 * replica,
        compute=compute,
        fingerprints=recipe.async_rl.handoff_checks,
        partial=rollout.partial,
        max_rows=rollout.max_rows,
        lengths=length_draw(rollout, seed=recipe.run.seed + 1000 * replica),
    )


def build_trainer(recipe: Any, model: Decoder, *, compute: ComputeThread) -> TorchTrainer:
    """The AdamW GRPO trainer of `model` (and its frozen reference copy when train.kl_coef > 0)."""
    rollout, train = recipe.rollout, recipe.train
    reference = None
    if train.kl_coef > 0:
        reference = copy.deepcopy(model).eval()
        reference.requires_grad_(False)
    return TorchTrainer(
        model,
        algorithm=algorithm_of(recipe),
        lr=train.lr,
        betas=(train.beta1, train.beta2),
        weight_decay=train.weight_decay,
        warmup_steps=train.warmup_steps,
        schedule=train.schedule,
        min_lr_ratio=train.min_lr_ratio,
        total_steps=recipe.run.steps,
        grad_clip=train.grad_clip,
        micro_batch_samples=train.micro_batch_samples,
        micro_batch_tokens=train.micro_batch_tokens,
        updates_per_step=train.updates_per_step,
        temperature=rollout.temperature,
        seed=recipe.run.seed + 2,
        reference=reference,
        master_weights=train.master_weights,
        offload_optimizer=train.offload_optimizer,
        compiled=train.compile,
        checkpointed=train.activation_checkpointing,
        compute=compute,
        fingerprints=recipe.async_rl.handoff_checks,
    )
