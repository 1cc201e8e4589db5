"""The Ray actors: a backend part (engine, trainer, or both colocated), a reward worker and an
environment worker.

All are async actors: their methods run on the actor's event loop, the torch work on the
backend's own compute threads (`backends/torch/compute.py`), so an engine replica batches the
requests that arrive together as the in-process engine does. The controller creates them
through `ray.remote(...)` with each one's resources (`backends/ray/place.py`) and only awaits
their methods. Every method returns plain values (or a weights package); nothing here keeps a
handle on the controller.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import anyio
import ray

from pipeline.clock import MonotonicTime
from pipeline.contracts.environments import ClosingEnvironment, Environment, Observation, Turn
from pipeline.contracts.messages import Prompt
from pipeline.contracts.protocols import Snapshotting
from pipeline.environments import resolve

if TYPE_CHECKING:  # importing torch here would load it before `runtime.load` could set it up
    from backends.input import Input
    from backends.ray.weights import Package, Transport
    from backends.ray.world import World

Role = Literal["engine", "trainer", "both"]
# (request id, prompt tokens, samples, greedy)
Request = tuple[int, tuple[int, ...], int, bool]


class BackendPart:
    """One actor's part of the backend, built where the actor runs from the backend's typed
    input (`backends/input.py`, pickled to it).

    `both`: the colocated pair sharing one model, as the recipe's backend builds it in one
    process (stand-down and wake instead of weight packages). Apart: `engine`, a replica of the
    engine the recipe's backend serves apart (`build_engine_alone`), sampling from its own copy
    of the weights, refreshed by `set_weights`;
    `trainer`, the recipe's backend's trainer alone, which publishes its weights as the
    engine's `Decoder` holds them (`served_parameters`) with `publish`. Under tensor
    or data parallelism (`world`) the actor joins the ranks' world as rank `rank` before it
    builds anything; rank 0 is the publishing one, and colocated, the first rank of each
    tensor-parallel group is a `both`, its engine replica `replica`.
    """

    def __init__(
        self,
        spec: Input,
        *,
        role: Role,
        vocab_size: int,
        stop_ids: Sequence[int],
        replica: int = 0,
        world: World | None = None,
        rank: int = 0,
    ) -> None:
        from backends.torch.runtime import load

        load()  # torch as the controller loads it (OpenMP's spinning, before the first import)
        from backends.registry import build_backend, build_engine_alone, build_trainer_alone

        if world is not None:  # rank `rank` of the trainer's tensor-parallel ranks
            from backends.ray.world import join

            join(world, rank)

        self.role = role
        self.version = 0  # of the weights this engine serves (set by set_weights)
        self.served: set[int] = set()  # request ids answered: none is answered twice
        self.engine: Any = None
        self.trainer: Any = None
        self.group: Any = None  # its process group for `placement.weights: collective`
        self.kept: Any = None  # the trainer's last broadcast (backends/ray/broadcast.py)
        self._snapshots: dict[str, Any] = {}  # a checkpoint's part taken, not yet written
        if role == "both":
            self.engine, self.trainer = build_backend(
                spec, vocab_size=vocab_size, stop_ids=stop_ids, replica=replica
            )
        elif role == "trainer":
            self.trainer = build_trainer_alone(spec, vocab_size=vocab_size)
        else:
            self.engine = build_engine_alone(spec, vocab_size=vocab_size, stop_ids=stop_ids, replica=replica)

    def where(self) -> dict[str, Any]:
        import ray

        context = ray.get_runtime_context()
        return {
            "pid": os.getpid(),
            "node_id": context.get_node_id(),
            "gpu_ids": context.get_accelerator_ids(),
        }

    async def generate(self, requests: list[Request]) -> tuple[int, int, bytes, dict[int, Exception]]:
        """Sample every request in one batched call; (version at the start, at the end, each
        request's completions in order (`wire.encode_completions`), the error of each request
        that failed, by its index). A refit between two batches moves the version."""
        from backends.ray.wire import encode_completions

        for request_id, *_ in requests:
            assert request_id not in self.served, f"request {request_id} answered twice"
        first = self.version
        results: list[Any] = [None] * len(requests)
        errors: dict[int, Exception] = {}

        async def one(index: int, request: Request) -> None:
            _, tokens, n, greedy = request
            try:
                results[index] = await self.engine.generate(tokens, n, greedy=greedy)
            except Exception as error:  # handed back per request, as the in-process engine does
                errors[index] = error

        async with anyio.create_task_group() as group:
            for index, request in enumerate(requests):
                group.start_soon(one, index, request)
        self.served.update(request_id for request_id, *_ in requests)
        return first, self.version, encode_completions(results), errors

    async def stand_down(self) -> int | None:
        await self.engine.stand_down()
        return self.engine.memory_in_use()

    async def wake(self) -> dict[str, int] | None:
        await self.engine.wake()
        return self.engine.fingerprint()

    async def set_weights(self, version: int, package: Package) -> dict[str, int] | None:
        """Serve `package` from the next batch on; it must be the announced `version`."""
        from backends.ray.weights import unpack

        like = self.engine.served_parameters()
        await self.engine.load_weights(unpack(package, version=version, like=like))
        self.version = version
        return self.engine.fingerprint()

    async def publish(self, version: int, transport: Transport) -> Package:
        from backends.ray.weights import pack

        return await self.trainer.compute.run(
            lambda: pack(version, self.trainer.served_parameters(), transport)
        )

    async def open_group(self, timeout_s: float) -> tuple[str, int]:
        """The trainer: a rendezvous for a new process group; (host, port)."""
        from backends.ray.broadcast import Group

        self.group = self.group or Group()
        return await anyio.to_thread.run_sync(self.group.open, timeout_s)

    async def join_group(self, *args: Any) -> None:
        """`Group.join`'s arguments."""
        from backends.ray.broadcast import Group

        self.group = self.group or Group()
        await anyio.to_thread.run_sync(self.group.join, *args)

    async def send_weights(self, version: int) -> None:
        """The trainer: broadcast its weights as `version`."""
        from backends.ray.broadcast import send

        kept = await self._keep(version)
        await anyio.to_thread.run_sync(send, kept)

    async def kept_weights(self, version: int) -> Package:
        """The trainer: an object-store package of the weights it broadcast as `version`."""
        kept = await self._keep(version)
        return await self.trainer.compute.run(kept.package, version)  # type: ignore[no-any-return]

    async def _keep(self, version: int) -> Any:
        """The buckets of `version`, copied on the compute thread the first time it is asked for:
        between a refit's start and the next train step the trainer's weights are that version."""
        from backends.ray.broadcast import bucketed

        if self.kept is None or self.kept.header.version != version:
            self.kept = await self.trainer.compute.run(
                lambda: bucketed(version, self.trainer.served_parameters())
            )
        return self.kept

    async def receive_weights(self, version: int) -> dict[str, int] | None:
        """An engine: receive the broadcast of `version` and serve it from the next batch on."""
        from backends.ray.broadcast import receive

        like = self.engine.served_parameters()
        await self.engine.load_weights(await anyio.to_thread.run_sync(receive, version, like))
        self.version = version
        return self.engine.fingerprint()

    async def train_step(self, groups: bytes) -> tuple[dict[str, float], dict[str, int] | None, int]:
        """One step on `groups` (`wire.encode_groups`); its metrics, fingerprint and the
        trainer's completed steps after it."""
        from backends.ray.wire import decode_groups

        metrics = await self.trainer.train_step(decode_groups(groups))
        return dict(metrics), self.trainer.fingerprint(), self.trainer.completed_steps

    def fingerprint(self) -> dict[str, int] | None:
        return self.trainer.fingerprint()  # type: ignore[no-any-return]

    async def save(self, part: Literal["engine", "trainer"], directory: str) -> None:
        """The part's own checkpoint files, written into `directory` (storage this node sees)."""
        await anyio.to_thread.run_sync(getattr(self, part).save, Path(directory))

    async def snapshot(self, part: Literal["engine", "trainer"], directory: str) -> bool:
        """The part's state taken now for a checkpoint in `directory`, kept here until
        `write_snapshot` (a part that cannot snapshot writes its files now); whether a write
        is left to do."""
        target = getattr(self, part)
        if not isinstance(target, Snapshotting):
            await anyio.to_thread.run_sync(target.save, Path(directory))
            return False
        snapshot = await anyio.to_thread.run_sync(target.snapshot, Path(directory))
        if getattr(snapshot, "written", False):  # written as it was taken (tensor parallelism)
            return False
        self._snapshots[part] = snapshot
        return True

    async def write_snapshot(self, part: Literal["engine", "trainer"]) -> None:
        """Write the part's last snapshot (while the next steps train: this is an async actor)."""
        pending = self._snapshots.pop(part, None)
        if pending is not None:
            await anyio.to_thread.run_sync(pending.write)

    async def load(self, part: Literal["engine", "trainer"], directory: str) -> int:
        """Load the part's files from `directory`; the trainer's completed steps after it."""
        await anyio.to_thread.run_sync(getattr(self, part).load, Path(directory))
        return self.trainer.completed_steps if part == "trainer" else 0


class RewardWorker:
    """Scores groups with the recipe's reward function, up to the actor's concurrency at once."""

    def __init__(self, function: str) -> None:
        from pipeline.rewards.scoring import resolve

        self.fn = resolve(function)

    def pid(self) -> int:
        return os.getpid()

    async def score(self, pairs: list[tuple[Any, str | None]]) -> list[Any]:
        from pipeline.rewards.scoring import score_all

        return await score_all(self.fn, pairs)


# The environment worker's concurrency groups (`ray.remote(concurrency_groups=...)`): `blocked_for`
# answers on a loop of its own while an environment holds the one the environments run on.
ENVIRONMENT_GROUPS = {"watch": 1}
_TICK_S = 0.1  # how often the environments' loop notes that it runs
_now = MonotonicTime().now


class EnvironmentWorker:
    """Holds episodes' environments (`rollout.environment`, one object an episode, built here
    from its `module:Class` and keyword arguments), each under the key the controller gave its
    episode; their calls interleave on this actor's event loop, as they would on the controller's.
    What an environment raises reaches the caller as Ray's task error around it.

    An environment that makes a synchronous call on that loop (a `time.sleep`, blocking I/O)
    holds every episode of the worker meanwhile: `blocked_for` says for how long it has, from a
    concurrency group of its own (`ENVIRONMENT_GROUPS`), which answers while the loop is held."""

    def __init__(self, name: str, args: dict[str, Any]) -> None:
        self.factory = resolve(name, args)
        self.live: dict[int, Environment] = {}
        self.beat: float | None = None  # when the environments' loop last ran its tick

    def pid(self) -> int:
        return os.getpid()

    async def start(self, key: int, prompt: Prompt) -> Observation:
        if self.beat is None:
            self._tick()
        self.live[key] = env = self.factory()
        return await env.start(prompt)

    async def step(self, key: int, turn: Turn) -> Observation:
        return await self.live[key].step(turn)

    def close(self, key: int) -> None:
        env = self.live.pop(key, None)
        if isinstance(env, ClosingEnvironment):
            env.close()

    def _tick(self) -> None:
        self.beat = _now()
        asyncio.get_running_loop().call_later(_TICK_S, self._tick)

    @ray.method(concurrency_group="watch")
    async def blocked_for(self) -> float:
        """Seconds the environments' event loop has been held by one synchronous call (0 while
        it runs, to within a tick)."""
        return 0.0 if self.beat is None else max(0.0, _now() - self.beat - _TICK_S)

    def episodes(self) -> int:
        """The episodes whose environments it holds now."""
        return len(self.live)
