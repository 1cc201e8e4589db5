"""Builds the megatron backend for a recipe: a megatron-core trainer and the engine
`rollout.engine` names.

The model section is the torch backend's (`model.config` from random weights, or `model.path`, a
Hugging Face directory): the torch `Decoder` is built or loaded first and its weights are
copied into the megatron `GPTModel`, so both start equal. Our torch engine (`rollout.engine:
torch`) samples from that `Decoder`, refreshed from megatron's weights by `reshard` (the
engine's `refresh_weights`) on each wake (colocated) or refit (separate); megatron's dynamic
inference engine (`megatron`, `backends/megatron/serve.py`) runs the `GPTModel` itself, and the
`Decoder` is let go once copied. On CPU the trainer steps with torch AdamW, on CUDA with
megatron's DDP and distributed optimizer (bf16 weights through float32 masters).

Train options the torch trainer has and this one does not yet are refused by name.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from backends.bench_lengths import LengthDraw
from backends.torch.build import DTYPES, build_model
from backends.torch.compute import ComputeThread
from backends.torch.engine import TorchEngine
from backends.torch.errors import ModelLoadError
from backends.torch.grpo_loss import LossConfig
from backends.torch.sampler import Sampler
from pipeline.errors import RecipeError

# train.<field>: (its default, what it would take)
_NOT_YET = {
    "kl_coef": (0.0, "a reference model"),
    "micro_batch_tokens": (0, "token-budgeted micro-batches"),
    "offload_optimizer": (False, "optimizer offload"),
    "activation_checkpointing": (False, "activation recomputation"),
    "master_weights": (True, "bf16 weights stepped without float32 masters"),
}


def check(recipe: Any) -> None:
    """Refuse, naming the field, what `train.backend: megatron` does not do."""
    for field, (default, feature) in _NOT_YET.items():
        value = getattr(recipe.train, field)
        if value != default:
            raise RecipeError(
                f"train.{field}: {value!r} needs {feature}, which train.backend megatron does not "
                f"have yet; use train.backend: torch, or leave train.{field} at {default!r}"
            )
    if recipe.model.dtype != "float32" and not recipe.model.device.startswith("cuda"):
        raise RecipeError(
            f"model.dtype: {recipe.model.dtype} with train.backend megatron needs model.device: cuda "
            "(on CPU it trains float32 only)"
        )


def require_megatron() -> None:
    """Refuse `train.backend: megatron` where megatron-core does not import, saying how to install it."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as error:
        raise RecipeError(
            f"train.backend: megatron needs megatron-core, which does not import here ({error}); "
            "install it with: pip install --no-deps --ignore-requires-python megatron-core==0.19.2 "
            "triton==3.6.0 (see README)"
        ) from None


def build_backend(recipe: Any, *, vocab_size: int, stop_ids: Sequence[int]) -> tuple[Any, Any]:
    check(recipe)
    require_megatron()
    # Imported once megatron is known to import (each of these imports it).
    from backends.megatron import layout, parallel, reshard
    from backends.megatron.model import build_gpt_model, compile_layers
    from backends.megatron.optimizer import MegatronAdam, TorchAdamW
    from backends.megatron.trainer import MegatronTrainer

    section, train, rollout = recipe.model, recipe.train, recipe.rollout
    seed = recipe.run.seed
    try:
        decoder = build_model(section, vocab_size=vocab_size, seed=seed)
    except ModelLoadError as error:  # a missing file or an unsupported model: the user's to fix
        raise RecipeError(f"model.path: {error}") from None
    config = decoder.config
    device = next(decoder.parameters()).device
    parallel.initialise(device=device, seed=recipe.run.seed)
    model = build_gpt_model(config, dtype=DTYPES[section.dtype], device=device)
    layout.load_hf(model, decoder.state_dict(), config)
    if train.compile:
        compile_layers(model)
    step = (MegatronAdam if device.type == "cuda" else TorchAdamW)(
        model,
        lr=train.lr,
        betas=(train.beta1, train.beta2),
        weight_decay=train.weight_decay,
        grad_clip=train.grad_clip,
    )
    # Colocated, engine and trainer never run at once: one thread (one OpenMP team) for both.
    trainer_thread = ComputeThread("trainer")
    trainer = MegatronTrainer(
        model,
        step,
        config=config,
        loss=LossConfig.of(train),
        lr=train.lr,
        warmup_steps=train.warmup_steps,
        schedule=train.schedule,
        min_lr_ratio=train.min_lr_ratio,
        total_steps=recipe.run.steps,
        micro_batch_samples=train.micro_batch_samples,
        updates_per_step=train.updates_per_step,
        temperature=rollout.temperature,
        seed=seed + 2,
        compute=trainer_thread,
        fingerprints=recipe.async_rl.handoff_checks,
    )
    if rollout.engine == "megatron":
        from backends.megatron.serve import build_inference

        del decoder  # copied into `model`; the engine serves `model` itself
        try:
            return build_inference(model, config, recipe, stop_ids=stop_ids, device=device), trainer
        except BaseException:
            trainer.close()
            raise
    engine = TorchEngine(
        # Engine kernels round as the trainer's megatron layers do (compiled or eager).
        Sampler(decoder, graphs=section.cuda_graphs, eager_rounding=not train.compile),
        shared=recipe.colocated,
        source=decoder,
        max_new_tokens=rollout.max_new_tokens,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        stop_token_ids=tuple(stop_ids),
        seed=seed + 1,
        compute=trainer_thread if recipe.colocated else ComputeThread("engine"),
        fingerprints=recipe.async_rl.handoff_checks,
        refresh_weights=functools.partial(reshard.copy_into, decoder, model, config),
        partial=rollout.partial,
        max_rows=rollout.max_rows,
        lengths=None
        if rollout.bench_lengths is None
        else LengthDraw(rollout.bench_lengths, max_new_tokens=rollout.max_new_tokens, seed=seed),
    )
    return engine, trainer
