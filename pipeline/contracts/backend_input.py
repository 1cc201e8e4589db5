"""The one typed input a compute backend is built from, instead of the whole recipe.

The shell builds it once from the recipe (`pipeline.shell.backend_input.backend_input`) and
hands it to the backend registry, the placement, and every Ray actor (it pickles); a backend
reads nothing of the recipe but this. Its parts:

- `model`: the model section (what to build or load, dtype, device);
- `sampling`: what an engine needs of `rollout` (and the rows a step admits);
- `optimizer`, `batching`: the optimizer's settings and the step's micro-batch shape;
- `algorithm`: the resolved RL algorithm (`pipeline.algorithms.config.Algorithm`);
- `seed`, `colocated`, `handoff_checks` (`async_rl.handoff_checks`);
- `placement`: where it runs (local, or Ray with its actors' resources);
- `options`: the backend's own knobs (`backends/torch/section.py: TrainerOptions`).

The types of `model`, `algorithm`, `placement` and `options` are the layers' above this one
(backends, algorithms): they are type parameters here, which `backends/input.py` fills in, so
this module depends on msgspec alone.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from pipeline.contracts.sections import BenchLengths

ModelT = TypeVar("ModelT")
AlgorithmT = TypeVar("AlgorithmT")
PlacementT = TypeVar("PlacementT")
OptionsT = TypeVar("OptionsT")


class Sampling(msgspec.Struct, kw_only=True, frozen=True):
    """An engine's sampling, from `rollout`: `max_rows` 0 is no cap; `rows_admitted` is the
    most rows the admitted batches hold at once (L + 1 batches of every sample, at most
    run.steps of them), which sizes what an engine must hold when `max_rows` does not."""

    max_new_tokens: int
    temperature: float
    top_p: float
    partial: bool
    max_rows: int
    rows_admitted: int
    bench_lengths: BenchLengths | None
    engine: str  # rollout.engine: torch | megatron
    kv_cache_gb: float
    episode_kv_gb: float  # rollout.episode_kv_gb: the torch engine's budget for episodes' kept KV
    graphs: bool  # rollout.graphs: megatron's engine replays its decode steps from CUDA graphs
    attention: str  # rollout.attention: megatron's engine's attention kernels


class Optimizer(msgspec.Struct, kw_only=True, frozen=True):
    """AdamW and its schedule over `total_steps` (run.steps), from `train`."""

    lr: float
    betas: tuple[float, float]
    weight_decay: float
    warmup_steps: int
    schedule: str
    min_lr_ratio: float
    grad_clip: float
    total_steps: int


class Batching(msgspec.Struct, kw_only=True, frozen=True):
    """How a step's samples are cut into micro-batches and optimizer updates, from `train`."""

    micro_batch_samples: int
    micro_batch_tokens: int
    updates_per_step: int


class BackendInput(
    msgspec.Struct, Generic[ModelT, AlgorithmT, PlacementT, OptionsT], kw_only=True, frozen=True
):
    """Everything a backend is built from (module docstring); `backend` names it
    (`train.backend`)."""

    backend: str
    model: ModelT
    sampling: Sampling
    optimizer: Optimizer
    batching: Batching
    algorithm: AlgorithmT
    seed: int
    colocated: bool
    handoff_checks: bool
    placement: PlacementT
    options: OptionsT
    reward_function: str  # what Ray reward workers score with (placement.reward_workers)
    # What Ray environment workers run (placement.environment_workers): rollout.environment
    # (None: single-turn) and rollout.environment_args.
    environment: str | None = None
    environment_args: dict[str, Any] = msgspec.field(default_factory=dict)
