"""Puts a recipe's backend on a Ray cluster (`placement.backend: ray`); blocking, on a worker thread.

- The Ray runtime: the one this process already joined (an embedding application's, the
  tests'), else `ray.init(address=placement.address)`: a runtime started for this run (address
  unset), or a cluster started by `ray start` ("auto", "HOST:PORT"). `close` shuts down only
  what this run started.
- Colocated: one actor holds the engine and the trainer (one model, the trainer's resources).
- Separate: `placement.engines` engine replicas and one trainer actor, each with its own CPUs,
  GPUs and custom resources. One engine and the trainer that fit on one GPU between them
  (engine_gpus + trainer_gpus <= 1) share a placement-group bundle, so Ray gives them the same
  GPU, and weights move by CUDA IPC; otherwise through the object store, or by a broadcast in
  one process group of them all (`placement.weights: collective`, `backends/ray/collective.py`).
  Every replica is loaded with the trainer's weights (through the object store) before the run
  starts.
- Tensor and data parallelism (`train.tensor_parallel` x `train.data_parallel` ranks): one
  trainer actor a rank, each with the trainer's resources, joined into one torch.distributed
  world through a rendezvous this process holds (`backends/ray/world.py`); colocated, the first
  rank of each tensor-parallel group also holds an engine replica (one a data-parallel rank).
- With `placement.reward_workers`, a pool of reward-worker actors scores the groups; with
  `placement.environment_workers`, a pool of environment-worker actors holds the episodes'
  environments (`backends/ray/environments.py`).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from backends.input import Input
from backends.placement import Placed, RayPlacement, gpus, shares_gpu, weights_transport
from backends.ray.actors import ENVIRONMENT_GROUPS, BackendPart, EnvironmentWorker, RewardWorker
from backends.ray.collective import Collective
from backends.ray.counters import PLACEMENT_COUNTERS
from backends.ray.engines import RayEngine, Replica
from backends.ray.environments import EnvironmentPool
from backends.ray.fits import check_fits, demands
from backends.ray.rewards import RewardPool
from backends.ray.trainer import RayTrainer
from backends.ray.weights import Transport
from pipeline.contracts.errors import PipelineError, RecipeError

log = logging.getLogger("backends.ray.place")
_say = logging.getLogger("pipeline.startup").info  # the run's start-up narration (pipeline/startup.py)

START_S = 600.0  # for the actors to come up (importing torch, building the model)
_Part = ray.remote(BackendPart)
_Rewards = ray.remote(RewardWorker)
# ray types `remote` without its concurrency_groups option, which it takes at run time
_Environments = ray.remote(concurrency_groups=ENVIRONMENT_GROUPS)(EnvironmentWorker)  # type: ignore[call-overload]


def place_on_ray(spec: Input, *, vocab_size: int, stop_ids: Sequence[int]) -> Placed:
    section = spec.placement
    assert isinstance(section, RayPlacement)  # backends.place's choice
    owned = not ray.is_initialized()
    if owned:
        # Ray runs its workers at niceness 15; here they do the run's compute, which beside
        # other busy processes then waits for the cores (slower steps).
        os.environ.setdefault("RAY_worker_niceness", "0")
        # "local": a runtime of its own even where another runs (Ray would join the newest).
        address = section.address or "local"
        _say(
            "starting Ray (placement.address %s)",
            address if section.address else "unset: a runtime of its own",
        )
        try:
            ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
        except ConnectionError as error:
            raise RecipeError(
                f"placement.address: {address}: {error}; start the cluster (ray start --head) or "
                "leave placement.address unset for a runtime of this run's own"
            ) from None
    cleanups: list[Callable[[], None]] = []

    def close() -> None:
        while cleanups:
            cleanups.pop()()

    if owned:
        cleanups.append(ray.shutdown)
    try:
        return _place(spec, section, vocab_size, stop_ids, cleanups, close)
    except BaseException:
        close()
        raise


def _place(
    spec: Input,
    section: RayPlacement,
    vocab_size: int,
    stop_ids: Sequence[int],
    cleanups: list[Callable[[], None]],
    close: Callable[[], None],
) -> Placed:
    _say("starting the actors (each loads torch and builds its part of the model)")
    counts: Counter[str] = Counter()
    build = {"vocab_size": vocab_size, "stop_ids": tuple(stop_ids)}
    device, ranks = spec.model.device, spec.options.ranks
    tensor_parallel = spec.options.tensor_parallel
    roles = {side: gpus(section, device, side) for side in ("engine", "trainer")}
    check_fits(demands(section, colocated=spec.colocated, ranks=ranks, gpus=roles), ray.nodes())
    trainer_options = _options(section.trainer_cpus, roles["trainer"], section.trainer_resources)
    engine_options = _options(section.engine_cpus, roles["engine"], section.engine_resources)
    weights = weights_transport(section, colocated=spec.colocated, device=device, ranks=ranks)
    # A broadcast's group loads the replicas' first weights and restarted ones' by package.
    transport: Transport = "cuda_ipc" if weights == "cuda_ipc" else "object_store"
    if shares_gpu(section, colocated=spec.colocated, device=device, ranks=ranks):
        cpus = section.engine_cpus + section.trainer_cpus
        group = placement_group([{"GPU": 1, **({"CPU": cpus} if cpus else {})}])
        cleanups.append(lambda: remove_placement_group(group))
        _started([group.ready()], section)  # a GPU taken by others: bounded, as the actors' start
        strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=0)
        trainer_options["scheduling_strategy"] = engine_options["scheduling_strategy"] = strategy

    world = None
    if ranks > 1:
        from backends.ray.world import rendezvous

        world, store = rendezvous(ranks, "nccl" if device.startswith("cuda") else "gloo", START_S)
        cleanups.append(lambda: store)  # holds the ranks' rendezvous until the run closes

    def start(options: dict[str, Any], role: str, replica: int = 0, rank: int | None = None) -> Any:
        ranked = {} if rank is None else {"world": world, "rank": rank}
        actor = _Part.options(**options).remote(spec, role=role, replica=replica, **ranked, **build)
        # ray's remote() is typed ActorHandle | type[T] (the latter for its method stubs), its
        # kill() takes only an ActorHandle.
        cleanups.append(lambda: ray.kill(actor))  # type: ignore[arg-type]
        return actor

    def start_trainer(colocated: bool) -> RayTrainer:
        """The trainer's ranks (one actor a rank: `world`); colocated, the first rank of each
        tensor-parallel group also holds an engine replica (rank r's is replica r // TP)."""
        ranked = world is not None
        actors = [
            start(
                trainer_options,
                "both" if colocated and rank % tensor_parallel == 0 else "trainer",
                replica=rank // tensor_parallel,
                rank=rank if ranked else None,
            )
            for rank in range(ranks)
        ]
        wheres = _started([a.where.remote() for a in actors], section)
        return RayTrainer(list(zip(actors, wheres, strict=True)), transport=transport)

    if spec.colocated:
        trainer = start_trainer(colocated=True)
        engine = RayEngine(
            [
                Replica(rank // tensor_parallel, actor, where)
                for rank, (actor, where) in enumerate(trainer.ranks)
                if rank % tensor_parallel == 0
            ],
            spawn=None,
            publish=None,
            colocated=True,
            max_restarts=0,
            counts=counts,
        )
    else:
        engine_actors = [start(engine_options, "engine", i) for i in range(section.engines)]
        trainer = start_trainer(colocated=False)
        wheres = _started([a.where.remote() for a in engine_actors], section)

        def spawn(index: int) -> tuple[Any, dict[str, Any]]:
            actor = start(engine_options, "engine", index)
            [where] = _started([actor.where.remote()], section)
            return actor, where

        engine = RayEngine(
            [Replica(i, a, w) for i, (a, w) in enumerate(zip(engine_actors, wheres, strict=True))],
            spawn=spawn,
            publish=trainer.publish,
            colocated=False,
            max_restarts=section.max_engine_restarts,
            counts=counts,
            collective=Collective(
                trainer,
                "nccl" if device.startswith("cuda") else "gloo",
                section.collective_timeout_s,
            )
            if weights == "collective"
            else None,
        )
        engine.version, engine.package = trainer.publish()
        ray.get([a.set_weights.remote(engine.version, engine.package) for a in engine_actors])
        engine.announced = engine.version
    log.info(
        "placed on Ray: trainer on node %s, engines on %s (weights by %s)",
        trainer.ranks[0][1]["node_id"][:12],
        ", ".join(r.where["node_id"][:12] for r in engine.replicas),
        weights,
    )
    score = None
    if section.reward_workers:
        reward_options = {"num_cpus": section.reward_cpus, "max_concurrency": section.reward_concurrency}

        def spawn_reward() -> tuple[Any, int]:
            actor = _Rewards.options(**reward_options).remote(spec.reward_function)
            cleanups.append(lambda: ray.kill(actor))  # type: ignore[arg-type]  # as in start()
            # ray types an undecorated actor method as the plain function, without .remote
            [pid] = _started([actor.pid.remote()], section)  # type: ignore[attr-defined]
            return actor, pid

        score = RewardPool(spawn_reward, section.reward_workers, counts=counts).score
    environment = None
    if section.environment_workers:
        assert spec.environment is not None  # backends.placement.check_placement's rule

        def spawn_environment() -> tuple[Any, int]:
            actor = _Environments.options(num_cpus=section.environment_cpus, max_restarts=0).remote(
                spec.environment, spec.environment_args
            )
            cleanups.append(lambda: ray.kill(actor))  # type: ignore[arg-type]  # as in start()
            [pid] = _started([actor.pid.remote()], section)  # type: ignore[attr-defined]  # as spawn_reward's
            return actor, pid

        pool = EnvironmentPool(spawn_environment, section.environment_workers, counts=counts)
        environment = pool.environment

    def counters() -> dict[str, float]:
        return {name: counts[name.removeprefix("placement/")] for name in PLACEMENT_COUNTERS}

    return Placed(
        engine=engine, trainer=trainer, close=close, score=score, environment=environment, counters=counters
    )


def _started(refs: list[Any], section: RayPlacement) -> list[Any]:
    """The actors' first answers, once they are up; a cluster without room for them says so
    instead of waiting forever."""
    try:
        return ray.get(refs, timeout=START_S)  # type: ignore[no-any-return]
    except ray.exceptions.GetTimeoutError:
        raise PipelineError(
            f"placement: the actors did not start within {START_S:g} s: the cluster may lack the CPUs, "
            f"GPUs or resources they ask for ({ray.available_resources()} free; the recipe's placement: "
            f"{msgspec.to_builtins(section)}); see `ray status`"
        ) from None


def _options(cpus: float, gpus: float, resources: dict[str, float]) -> dict[str, Any]:
    # Ray restarts no actor and retries no call: an engine is replaced by its proxy, after which
    # it is re-synced; a trainer's death ends the run.
    return {"num_cpus": cpus, "num_gpus": gpus, "resources": dict(resources), "max_restarts": 0}
