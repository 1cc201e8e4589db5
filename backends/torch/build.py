"""The torch backend (`train.backend: torch`): builds its engine and trainer from the backend's
typed input (`backends/input.py`), colocated (one model, one compute thread) or not."""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from backends.bench_lengths import length_draw
from backends.torch import runtime
from backends.torch.compute import ComputeThread
from backends.torch.engine import TorchEngine
from backends.torch.errors import ModelLoadError
from backends.torch.model import Decoder
from backends.torch.sampler import Sampler
from backends.torch.section import ModelSection
from backends.torch.trainer import TorchTrainer
from pipeline.contracts.errors import RecipeError

if TYPE_CHECKING:  # its alias names this package's sections: only the types are read here
    from backends.input import Input

log = logging.getLogger(__name__)
_told_spinning = False

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check(spec: Input) -> None:
    """Refuse, naming the field, what `train.backend: torch` does not do."""
    if spec.options.tensor_parallel > 1:
        raise RecipeError(
            f"train.tensor_parallel: {spec.options.tensor_parallel} needs train.backend: megatron "
            "(the torch trainer holds the whole model on one device)"
        )


def build_model(section: ModelSection, *, vocab_size: int, seed: int) -> Decoder:
    if section.threads:
        torch.set_num_threads(section.threads)
    global _told_spinning
    if (
        section.device == "cpu"
        and torch.get_num_threads() > 1
        and runtime.spins_by_default()
        and not _told_spinning
    ):
        _told_spinning = True  # once a process: nothing a later run does changes it
        log.warning(
            "torch was imported before the pipeline with OpenMP's default spinning: beside other "
            "busy processes its %d threads can make steps many times slower; set GOMP_SPINCOUNT=1000 "
            "in the environment before importing torch (or model.threads: 1)",
            torch.get_num_threads(),
        )
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
    spec: Input, *, vocab_size: int, stop_ids: Sequence[int], replica: int = 0
) -> tuple[TorchEngine, TorchTrainer]:
    """(engine, trainer) sharing one model when `spec.colocated`, else two copies; `replica`:
    the engine's index (colocated data parallelism: one replica on each rank)."""
    model = build_model(spec.model, vocab_size=vocab_size, seed=spec.seed)
    engine_model = model if spec.colocated else copy.deepcopy(model)
    # Colocated, engine and trainer never run at once: one thread (one OpenMP team) for both.
    trainer_thread = ComputeThread("trainer")
    engine_thread = trainer_thread if spec.colocated else ComputeThread("engine")
    engine = build_engine(
        spec,
        engine_model,
        shared=spec.colocated,
        source=model,
        stop_ids=stop_ids,
        compute=engine_thread,
        replica=replica,
    )
    return engine, build_trainer(spec, model, compute=trainer_thread)


def build_trainer_alone(spec: Input, *, vocab_size: int) -> TorchTrainer:
    """The trainer alone, on a model of its own (a Ray trainer actor, whose engines are elsewhere)."""
    model = build_model(spec.model, vocab_size=vocab_size, seed=spec.seed)
    return build_trainer(spec, model, compute=ComputeThread("trainer"))


def build_engine_alone(
    spec: Input, *, vocab_size: int, stop_ids: Sequence[int], replica: int = 0
) -> TorchEngine:
    """Engine replica `replica` on a model of its own (a Ray engine actor, apart from the
    trainer), which `load_weights` refreshes."""
    model = build_model(spec.model, vocab_size=vocab_size, seed=spec.seed)
    return build_engine(
        spec,
        model,
        shared=False,
        source=model,
        stop_ids=stop_ids,
        compute=ComputeThread("engine"),
        replica=replica,
    )


def build_engine(
    spec: Input,
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
    sampling = spec.sampling
    return TorchEngine(
        # Engine kernels round as the trainer's do (compiled or eager): closer logprobs.
        Sampler(model, graphs=spec.model.cuda_graphs, eager_rounding=not spec.options.compile),
        shared=shared,
        source=source,
        max_new_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        stop_token_ids=tuple(stop_ids),
        seed=spec.seed + 1 + 1000 * replica,
        compute=compute,
        fingerprints=spec.handoff_checks,
        partial=sampling.partial,
        max_rows=sampling.max_rows,
        lengths=length_draw(sampling, seed=spec.seed + 1000 * replica),
        keep_bytes=int(sampling.episode_kv_gb * 2**30),
    )


def build_trainer(spec: Input, model: Decoder, *, compute: ComputeThread) -> TorchTrainer:
    """The AdamW GRPO trainer of `model` (and its frozen reference copy when train.kl_coef > 0)."""
    reference = None
    if spec.algorithm.loss.kl_coef > 0:
        reference = copy.deepcopy(model).eval()
        reference.requires_grad_(False)
    ranks = None
    if spec.options.data_parallel > 1:  # this process is one rank (a Ray actor that joined them)
        from backends.torch.data_parallel import RankGroup

        ranks = RankGroup.world()
        assert ranks.size == spec.options.data_parallel, "the ranks' world is the data-parallel group"
    return TorchTrainer(
        model,
        algorithm=spec.algorithm,
        optimizer=spec.optimizer,
        batching=spec.batching,
        options=spec.options,
        temperature=spec.sampling.temperature,
        seed=spec.seed + 2,
        reference=reference,
        compute=compute,
        fingerprints=spec.handoff_checks,
        ranks=ranks,
    )
