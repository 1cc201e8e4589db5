"""Where the backend runs: in this process (`local`, the default) or on a Ray cluster (`ray`).

The recipe's `placement` section picks one; nothing else in a recipe changes between a laptop
and a cluster. `backends.place.place(spec, ...)` builds what the pipeline drives, on a worker
thread:

- `local`: the backend's engine and trainer in this process (today's wiring);
- `ray` (`backends/ray/place.py`): engine replicas, the trainer and, with `reward_workers`, the
  reward workers (with `environment_workers`, the environment workers) as Ray actors, behind
  proxies that keep the pipeline's `Engine` and `Trainer` protocols, the reward stage's scoring
  function and the rollout's environment factory; the gate, the clock and the tickets stay in
  the controller.

Importing this module imports neither torch nor ray.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from pipeline.contracts.environments import Environment
from pipeline.contracts.errors import RecipeError
from pipeline.contracts.sections import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Section

# Scores a group's (prompt, completion text or None) pairs: pipeline.rewards.scoring.score_all's contract.
Scorer = Callable[[list[tuple[Any, str | None]]], Awaitable[list[Any]]]


class LocalPlacement(Section, tag_field="backend", tag="local", frozen=True):
    """Engine and trainer in this process, on worker threads."""


class RayPlacement(Section, tag_field="backend", tag="ray", frozen=True):
    """Engine replicas, the trainer and reward workers as actors of a Ray cluster."""

    # None: start a Ray runtime for this run on this machine (even where another one runs) and
    # stop it at the end; "auto" or
    # "HOST:PORT": join the cluster that `ray start --head` started (it outlives the run).
    address: str | None = None
    engines: PositiveInt = 1  # engine replicas (colocated: 1, inside the trainer's actor)
    engine_cpus: NonNegativeFloat = 1.0
    trainer_cpus: NonNegativeFloat = 1.0
    # Unset: 1 with model.device cuda, else 0. 0.5 each: engine and trainer share one GPU.
    engine_gpus: NonNegativeFloat | None = None
    trainer_gpus: NonNegativeFloat | None = None
    # Ray custom resources each actor asks for: pin engines and trainer to the nodes that
    # declare them (`ray start --resources '{"trainer": 1}'`).
    engine_resources: dict[str, PositiveFloat] = msgspec.field(default_factory=dict)
    trainer_resources: dict[str, PositiveFloat] = msgspec.field(default_factory=dict)
    # Reward workers (0: score in the controller, as `local` does): each scores up to
    # `reward_concurrency` groups at once.
    reward_workers: NonNegativeInt = 0
    reward_cpus: NonNegativeFloat = 1.0
    reward_concurrency: PositiveInt = 8
    # Environment workers (0: the environments of rollout.environment run in the controller):
    # each episode's environment is built and run in one of them (the one with the fewest
    # episodes in hand), under the same rollout.env_s and rollout.max_env_failures; a worker that
    # dies fails the episodes it held and is replaced.
    environment_workers: NonNegativeInt = 0
    environment_cpus: NonNegativeFloat = 1.0
    # Engine actors that died and were replaced, over the whole run, before it stops.
    max_engine_restarts: NonNegativeInt = 3
    # How the trainer's weights reach separate engines (`weights_transport`); auto: CUDA IPC
    # where one engine and the trainer share a GPU, else the object store.
    weights: Literal["auto", "object_store", "cuda_ipc", "collective"] = "auto"
    # collective: how long a member waits on another (one that died) before the refit starts
    # again in a new group.
    collective_timeout_s: PositiveFloat = 60.0


Placement = LocalPlacement | RayPlacement


@dataclass
class Placed:
    """What `place` built: the engine and trainer the pipeline drives, the reward stage's
    scorer (None: the stage scores in this process), the rollout's environment factory (None:
    its environments run in this process), the placement's running counts for the metrics, and
    `close`, which lets go of everything (threads, actors, the Ray runtime)."""

    engine: Any
    trainer: Any
    close: Callable[[], None]
    score: Scorer | None = None
    environment: Callable[[], Environment] | None = None
    counters: Callable[[], dict[str, float]] = field(default=dict)


def gpus(placement: Placement, device: str, side: str) -> float:
    """The GPUs the `side` ("engine" or "trainer") actor asks Ray for (`device`: model.device)."""
    asked = getattr(placement, f"{side}_gpus", None)
    if asked is None:
        return 1.0 if device.startswith("cuda") else 0.0
    return float(asked)


def shares_gpu(placement: Placement, *, colocated: bool, device: str, ranks: int) -> bool:
    """One engine and the trainer (of one rank: `ranks` trainer ranks in all), apart, that fit
    on one GPU between them: Ray puts them in one placement-group bundle (the same GPU)."""
    engine, trainer = gpus(placement, device, "engine"), gpus(placement, device, "trainer")
    return (
        isinstance(placement, RayPlacement)
        and not colocated
        and placement.engines == 1
        and ranks == 1
        and 0 < engine
        and 0 < trainer
        and engine + trainer <= 1
    )


def weights_transport(placement: RayPlacement, *, colocated: bool, device: str, ranks: int) -> str:
    """`placement.weights` resolved: object_store, cuda_ipc or collective."""
    asked: str = placement.weights
    if asked == "auto":
        shared = shares_gpu(placement, colocated=colocated, device=device, ranks=ranks)
        return "cuda_ipc" if shared else "object_store"
    return asked


def check_ray() -> None:
    """`placement.backend: ray` needs the ray package here (and on every node)."""
    if importlib.util.find_spec("ray") is None:
        raise RecipeError(
            "placement.backend: ray needs the ray package: pip install 'ray>=2.60' "
            "(or this project's extra: pip install -e '.[ray]')"
        )


def check_placement(
    section: Placement,
    *,
    colocated: bool,
    device: str,
    tensor_parallel: int,
    partial: bool,
    reward_function: str,
    environment: str | None = None,
    data_parallel: int = 1,
) -> None:
    """Cross-field rules of `placement` against the rest of the recipe (ValueError naming both)."""
    if not isinstance(section, RayPlacement):
        if data_parallel > 1:
            raise ValueError(
                f"train.data_parallel: {data_parallel} needs placement.backend: ray (a pipeline "
                "process is one rank: Ray starts one trainer actor a rank)"
            )
        return

    def gpus_of(side: str) -> float:
        return gpus(section, device, side)

    if colocated and section.engines > 1:
        raise ValueError(
            f"placement.engines: {section.engines} needs colocated: false (colocated, the one "
            "engine shares the trainer's actor and weights)"
        )
    if device.startswith("cuda"):
        sides = ("trainer",) if colocated else ("trainer", "engine")
        for side in sides:
            if gpus_of(side) == 0:
                raise ValueError(
                    f"placement.{side}_gpus: 0, but model.device: {device}: Ray shows "
                    f"an actor only the GPUs it asks for; leave it unset (a GPU of its own) or set "
                    "0.5 for the engine and the trainer each (the two share one GPU)"
                )
    ranks = tensor_parallel * data_parallel
    if ranks > 1 and device.startswith("cuda") and gpus_of("trainer") < 1:
        field = "train.tensor_parallel" if tensor_parallel > 1 else "train.data_parallel"
        size = tensor_parallel if tensor_parallel > 1 else data_parallel
        raise ValueError(
            f"{field}: {size} with placement.trainer_gpus: {gpus_of('trainer'):g}: "
            "NCCL takes one rank per GPU, so each trainer rank needs a GPU of its own: leave "
            "placement.trainer_gpus unset"
        )
    weights = section.weights
    if weights != "auto" and colocated:
        raise ValueError(
            f"placement.weights: {weights} needs colocated: false (colocated, the engine shares the "
            "trainer's weights): set placement.weights: auto"
        )
    shared = shares_gpu(section, colocated=colocated, device=device, ranks=ranks)
    if weights == "cuda_ipc" and not colocated and not shared:
        raise ValueError(
            "placement.weights: cuda_ipc needs one engine and the trainer on one GPU (placement.engines: "
            "1, model.device: cuda, engine_gpus + trainer_gpus <= 1): set placement.weights: auto"
        )
    if weights == "collective" and device.startswith("cuda"):
        for side in ("trainer", "engine"):
            if gpus_of(side) < 1:
                raise ValueError(
                    f"placement.weights: collective, but placement.{side}_gpus: {gpus_of(side):g}: "
                    "NCCL takes one rank per GPU, so each actor needs a GPU of its own: leave "
                    f"placement.{side}_gpus unset, or set placement.weights: auto"
                )
    if partial:
        raise ValueError(
            "rollout.partial: true is not built for placement.backend ray yet (an engine actor "
            "does not freeze its rows at a stand-down): set rollout.partial: false or "
            "placement.backend: local"
        )
    if section.environment_workers and environment is None:
        raise ValueError(
            f"placement.environment_workers: {section.environment_workers} needs rollout.environment "
            "(module:Class): a single-turn run has no environments to run; set "
            "placement.environment_workers: 0"
        )
    if section.reward_workers and reward_function == "reasoning_gym":
        raise ValueError(
            "placement.reward_workers: reward.function 'reasoning_gym' checks answers with the "
            "prompt source's own objects, which stay in the controller: set placement.reward_workers: 0"
        )
