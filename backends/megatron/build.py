"""Builds the megatron backend from its typed input (`backends/input.py`): a megatron-core
trainer and the engine `rollout.engine` names.

The model section is the torch backend's (`model.config` from random weights, or `model.path`, a
Hugging Face directory): the torch `Decoder` is built or loaded first and its weights are
copied into the megatron `GPTModel`, so both start equal. Our torch engine (`rollout.engine:
torch`) samples from that `Decoder`, refreshed from megatron's weights by `reshard` (the
engine's `refresh_weights`) on each wake (colocated) or refit (separate); megatron's dynamic
inference engine (`megatron`, `backends/megatron/serve.py`) runs the `GPTModel` itself
(colocated) or a copy of it refreshed at each refit (separate, `backends/megatron/apart.py`),
and the `Decoder` is let go once copied. On CPU the trainer steps with torch AdamW, on CUDA with
megatron's DDP and distributed optimizer (bf16 weights through float32 masters).

Train options the torch trainer has and this one does not yet are refused by name.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

import torch

from backends.bench_lengths import length_draw
from backends.input import Input
from backends.placement import RayPlacement
from backends.torch.build import DTYPES, build_model
from backends.torch.compute import ComputeThread
from backends.torch.engine import TorchEngine
from backends.torch.sampler import Sampler
from pipeline.contracts.errors import RecipeError

# train.<field>: (its value in the input, its default, what it would take)
_NOT_YET: dict[str, tuple[Callable[[Input], Any], Any, str]] = {
    "kl_coef": (lambda spec: spec.algorithm.loss.kl_coef, 0.0, "a reference model"),
    "offload_optimizer": (lambda spec: spec.options.offload_optimizer, False, "optimizer offload"),
    "activation_checkpointing": (
        lambda spec: spec.options.activation_checkpointing,
        False,
        "activation recomputation",
    ),
    "master_weights": (
        lambda spec: spec.options.master_weights,
        True,
        "bf16 weights stepped without float32 masters",
    ),
}


def check(spec: Input) -> None:
    """Refuse, naming the field, what `train.backend: megatron` does not do, and a Python
    environment it cannot run in."""
    require_megatron()
    for field, (read, default, feature) in _NOT_YET.items():
        value = read(spec)
        if value != default:
            raise RecipeError(
                f"train.{field}: {value!r} needs {feature}, which train.backend megatron does not "
                f"have yet; use train.backend: torch, or leave train.{field} at {default!r}"
            )
    ray = isinstance(spec.placement, RayPlacement)
    size = spec.options.tensor_parallel
    if size > 1 and not ray:
        raise RecipeError(
            f"train.tensor_parallel: {size} needs placement.backend: ray (a "
            "pipeline process is one rank: Ray starts one trainer actor a rank)"
        )
    if isinstance(spec.placement, RayPlacement) and spec.placement.weights == "collective":
        raise RecipeError(
            "placement.weights: collective is not built for train.backend megatron (its broadcast "
            "group would replace the process group megatron's trainer holds); set "
            "placement.weights: auto"
        )
    model = spec.model
    if model.config is not None:  # a model.path's config is read when it is built
        check_shape(model.config, size)
    if model.dtype != "float32" and not model.device.startswith("cuda"):
        raise RecipeError(
            f"model.dtype: {model.dtype} with train.backend megatron needs model.device: cuda "
            "(on CPU it trains float32 only)"
        )


# What megatron-core needs and does not declare (installed with --no-deps, it does not bring
# them): `psutil` for dist_checkpointing's save workers (without it a run trains, then fails at
# its first save), `tqdm` for its inference engines.
_UNDECLARED = ("psutil", "tqdm")


def require_megatron() -> None:
    """Refuse `train.backend: megatron` where megatron-core, or what it needs without declaring
    it, does not import, saying how to install it (`validate` and `run` check it before training)."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as error:
        raise RecipeError(
            f"train.backend: megatron needs megatron-core, which does not import here ({error}); "
            "install it with: pip install --no-deps --ignore-requires-python megatron-core==0.19.2 "
            "triton==3.6.0 && pip install psutil tqdm (see README)"
        ) from None
    missing = [name for name in _UNDECLARED if importlib.util.find_spec(name) is None]
    if missing:
        raise RecipeError(
            f"train.backend: megatron needs {' and '.join(missing)}, which megatron-core uses without "
            f"declaring it; install with: pip install {' '.join(missing)} (or this project's extra: "
            "pip install -e '.[megatron]')"
        )


def build_backend(
    spec: Input, *, vocab_size: int, stop_ids: Sequence[int], replica: int = 0
) -> tuple[Any, Any]:
    """The engine `rollout.engine` names and the megatron trainer (this process's rank of it);
    `replica`: the colocated engine's index among the data-parallel ranks."""
    decoder, trainer = _build(spec, vocab_size=vocab_size)
    from backends.megatron import reshard

    sampling = spec.sampling
    if sampling.engine == "megatron":
        from backends.megatron.apart import EngineCopy
        from backends.megatron.serve import build_inference

        del decoder  # copied into the trainer's model; the engine serves that model or a copy
        try:
            copy = None
            if not spec.colocated:
                copy = EngineCopy(trainer.model, trainer.config, fingerprints=spec.handoff_checks)
            served = trainer.model if copy is None else copy.model
            return (
                build_inference(
                    served,
                    trainer.config,
                    spec,
                    stop_ids=stop_ids,
                    device=trainer.device,
                    copy=copy,
                    replica=replica,
                ),
                trainer,
            )
        except BaseException:
            trainer.close()
            raise
    refresh: Any = functools.partial(reshard.copy_into, decoder, trainer.model, trainer.config)
    if spec.options.tensor_parallel > 1:
        # A wake or refit on this rank alone cannot gather the other ranks' shards: every rank
        # gathers after each step and load, and this one copies the result in then.
        trainer.on_weights = functools.partial(_copy_served, decoder)
        trainer.weights_changed()  # as every other rank does once built
        refresh = None
    engine = TorchEngine(
        # Engine kernels round as the trainer's megatron layers do (compiled or eager).
        Sampler(decoder, graphs=spec.model.cuda_graphs, eager_rounding=not spec.options.compile),
        shared=spec.colocated,
        source=decoder,
        max_new_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        stop_token_ids=tuple(stop_ids),
        seed=spec.seed + 1 + 1000 * replica,  # as the torch backend's replicas
        compute=trainer.compute if spec.colocated else ComputeThread("engine"),
        fingerprints=spec.handoff_checks,
        refresh_weights=refresh,
        partial=sampling.partial,
        max_rows=sampling.max_rows,
        lengths=length_draw(sampling, seed=spec.seed + 1000 * replica),
        keep_bytes=int(sampling.episode_kv_gb * 2**30),
    )
    return engine, trainer


def build_engine_alone(spec: Input, *, vocab_size: int, stop_ids: Sequence[int], replica: int = 0) -> Any:
    """An engine replica apart from the megatron trainer, refreshed from the trainer's weights
    as the engine's `Decoder` holds them (`reshard.served`): our torch engine, or with
    `rollout.engine: megatron` megatron's over a `GPTModel` of the replica's own
    (`apart.ReplicaCopy`). Importing this module set megatron's warning filters: the
    trainer's weights arrive pickled through megatron's `safe_load_from_bytes`, which the
    unpickling imports."""
    if spec.sampling.engine == "megatron":
        from backends.megatron.apart import ReplicaCopy
        from backends.megatron.serve import build_inference

        check(spec)
        _, model, config = _gpt_model(spec, vocab_size=vocab_size)
        copy = ReplicaCopy(model, config, fingerprints=spec.handoff_checks)
        return build_inference(
            model, config, spec, stop_ids=stop_ids, device=copy.device, copy=copy, replica=replica
        )
    from backends.torch.build import build_engine_alone as torch_engine

    return torch_engine(spec, vocab_size=vocab_size, stop_ids=stop_ids, replica=replica)


def build_trainer_alone(spec: Input, *, vocab_size: int) -> Any:
    """This process's rank of the megatron trainer alone (a Ray trainer actor, whose engines are
    elsewhere). Rank 0 keeps the served weights after each step (`served_parameters`), which it
    publishes: the last two versions stay alive, as a CUDA IPC package handed to a replaced
    replica may be the one before (at one rank some of them, the norms, are the live
    parameters themselves, as the torch trainer's are); under tensor parallelism they are
    gathered from every rank then, the one point where all ranks run together."""
    import torch.distributed as dist

    _, trainer = _build(spec, vocab_size=vocab_size)
    if dist.get_rank() == 0:
        trainer.keep_served()
    trainer.weights_changed()  # every rank, once built: rank 0 keeps the first weights
    return trainer


@torch.no_grad()
def _copy_served(decoder: Any, served: list[tuple[str, Any]]) -> None:
    weights = dict(served)
    for name, target in decoder.named_parameters():
        target.copy_(weights[name])


def _gpt_model(spec: Input, *, vocab_size: int) -> tuple[Any, Any, Any]:
    """(the torch `Decoder` the model section gives, this rank's megatron copy of it, its
    `ModelConfig`), in megatron's process groups of `train.tensor_parallel` ranks."""
    # Imported once megatron is known to import (each of these imports it).
    from megatron.core import parallel_state

    from backends.megatron import layout, parallel
    from backends.megatron.model import build_gpt_model

    section, seed = spec.model, spec.seed
    decoder = build_model(section, vocab_size=vocab_size, seed=seed)
    config = decoder.config
    size = spec.options.tensor_parallel
    if section.config is None:  # `check` did it for a config in the recipe
        check_shape(config, size)
    device = next(decoder.parameters()).device
    parallel.initialise(tensor_parallel=size, device=device, seed=seed)
    model = build_gpt_model(config, dtype=DTYPES[section.dtype], device=device, tensor_parallel=size)
    layout.load_hf(
        model, decoder.state_dict(), config, rank=parallel_state.get_tensor_model_parallel_rank(), size=size
    )
    return decoder, model, config


def _build(spec: Input, *, vocab_size: int) -> tuple[Any, Any]:
    """(the torch `Decoder` the model section gives, the trainer of this rank's megatron copy of it)."""
    check(spec)
    from backends.megatron.model import compile_layers
    from backends.megatron.optimizer import MegatronAdam, TorchAdamW
    from backends.megatron.trainer import MegatronTrainer

    optimizer, seed = spec.optimizer, spec.seed
    decoder, model, config = _gpt_model(spec, vocab_size=vocab_size)
    device = next(model.parameters()).device
    if spec.options.compile:
        compile_layers(model)
    step = (MegatronAdam if device.type == "cuda" else TorchAdamW)(
        model,
        lr=optimizer.lr,
        betas=optimizer.betas,
        weight_decay=optimizer.weight_decay,
        grad_clip=optimizer.grad_clip,
    )
    trainer = MegatronTrainer(
        model,
        step,
        config=config,
        algorithm=spec.algorithm,
        optimizer=optimizer,
        batching=spec.batching,
        temperature=spec.sampling.temperature,
        seed=seed + 2,
        # Colocated, engine and trainer never run at once: one thread (one OpenMP team) for both.
        compute=ComputeThread("trainer"),
        fingerprints=spec.handoff_checks,
    )
    return decoder, trainer


def check_shape(config: Any, size: int) -> None:
    """The model's dimensions that `train.tensor_parallel` ranks must divide."""
    for field in ("num_attention_heads", "num_key_value_heads", "vocab_size", "intermediate_size"):
        value = getattr(config, field)
        if value % size:
            raise RecipeError(
                f"train.tensor_parallel: {size} does not divide the model's {field} ({value}); "
                f"pick a tensor_parallel that does"
            )
