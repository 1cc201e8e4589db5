"""The megatron engine as the builder wires it (`rollout.engine: megatron`), through the real
gate and trainer on the CPU, with megatron's dynamic engine replaced by a fake that holds a KV
buffer where megatron's context does and, like megatron's inference, refuses to step a model in
train mode (megatron's engine itself needs CUDA: tests/gpu/test_megatron_gpu.py runs it).

- Eval mode: the engine serves the trainer's own module, which each train step puts in train
  mode; every wake (and the build) puts it back in eval mode before the engine steps it.
- Stand-down memory: with handoff checks the gate reads the engine's KV bytes after each
  stand-down; a cache that was not let go fails the step. Without graphs megatron's suspend
  drops the cache (recompute); with them (`rollout.graphs`) megatron keeps it
  (persist) and the builder's `KVHandoff` gives its memory back unless a request still holds it.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron.core.inference.config import KVCacheManagementMode  # noqa: E402

from backends.megatron import serve  # noqa: E402
from backends.megatron.build import build_backend  # noqa: E402
from backends.torch.kv_pool import PlainPool  # noqa: E402
from pipeline.clock import DeadlineClock, MonotonicTime  # noqa: E402
from pipeline.contracts.errors import HandoffMismatch  # noqa: E402
from pipeline.contracts.messages import TrainGroup, TrainSample  # noqa: E402
from pipeline.gate import EngineGate  # noqa: E402
from pipeline.testing import FakeDynamicEngine  # noqa: E402
from tests.backends.test_megatron_serve import _on_cpu  # noqa: E402

KV_BYTES = 4096


class ServingEngine(FakeDynamicEngine):
    """A `FakeDynamicEngine` over the trainer's model: its KV buffer sits at
    `context.memory_buffer` as megatron's does, let go at `suspend()` unless `keeps_cache`; a
    step on a model in train mode fails as megatron's inference attention does. Graphed (a
    `pool`): the buffer is the pool's and `suspend()` keeps it, as megatron's persist mode does;
    `keeps_cache` then leaves a request in the context."""

    def __init__(self, model: Any, *, keeps_cache: bool, pool: Any = None) -> None:
        super().__init__(length=3, vocab=16)
        self.model = model
        self.keeps_cache = keeps_cache
        self.pool = pool
        buffer = torch.empty(KV_BYTES, dtype=torch.uint8) if pool is None else pool.allocate(KV_BYTES)
        self.context = SimpleNamespace(memory_buffer=buffer, total_request_count=0)
        self.modes: list[bool] = []  # the model's `training` at each step

    def step_modern(self) -> dict[str, Any]:
        self.modes.append(self.model.training)
        if self.model.training:
            raise AssertionError("megatron's inference needs the model in eval mode")
        return super().step_modern()

    def suspend(self) -> None:
        super().suspend()
        if self.pool is not None:
            self.context.total_request_count = int(self.keeps_cache)
        elif not self.keeps_cache:
            self.context.memory_buffer = None

    def resume(self) -> None:
        super().resume()
        if self.pool is None:
            self.context.memory_buffer = torch.empty(KV_BYTES, dtype=torch.uint8)


class ModelEngine(FakeDynamicEngine):
    """A `FakeDynamicEngine` over the model it was built for: each step records that model's
    weights as they are then (a copy of its word embeddings), what the real engine would read;
    its controller holds the logits megatron's async schedule keeps between steps."""

    def __init__(self, model: Any, **options: Any) -> None:
        super().__init__(vocab=16, **options)
        self.model = model
        self.seen: list[Any] = []
        self.controller = SimpleNamespace(_async_sched_logits=_PendingLogits())
        self.context = SimpleNamespace(memory_buffer=None)  # no KV cache held

    def step_modern(self) -> dict[str, Any]:
        self.seen.append(self.model.embedding.word_embeddings.weight.detach().clone())
        self.controller._async_sched_logits.is_valid = True  # the next token's forward, launched
        return super().step_modern()


class _PendingLogits:
    is_valid = False

    def clear(self) -> None:
        self.is_valid = False


def _backend(
    monkeypatch: pytest.MonkeyPatch, *, keeps_cache: bool = False, graphs: bool = False
) -> tuple[Any, Any, ServingEngine]:
    made: list[ServingEngine] = []

    def engine_on_cpu(model, inference, *, tokens, seed, device, graphs, sampler, attention):
        pool = None if graphs is None else graphs.pool
        made.append(ServingEngine(model, keeps_cache=keeps_cache, pool=pool))
        return made[-1]

    monkeypatch.setattr(serve, "dynamic_engine", engine_on_cpu)
    monkeypatch.setattr(serve, "VirtualMemoryPool", PlainPool)  # the driver's, on CUDA
    recipe = _on_cpu("async_rl.handoff_checks=true", graphs=graphs)
    engine, trainer = build_backend(recipe, vocab_size=16, stop_ids=[1])
    return engine, trainer, made[0]


def _groups() -> list[TrainGroup]:
    return [
        TrainGroup(
            group_id="0-0",
            prompt_tokens=(2, 3, 4),
            samples=tuple(
                TrainSample(tokens=(5 + i, 6, 7), logprobs=(-2.0,) * 3, reward=0.0, advantage=advantage)
                for i, advantage in enumerate([1.0, -1.0])
            ),
        )
    ]


async def test_the_engine_steps_the_trainers_model_in_eval_mode_after_each_train_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine, trainer, fake = _backend(monkeypatch)
    gate = EngineGate(engine, DeadlineClock(MonotonicTime()), checks=trainer)
    try:
        assert not trainer.model.training  # the build leaves it serving
        await engine.generate([3, 4], 2)
        for _ in range(2):
            await gate.step(lambda: trainer.train_step(_groups()))
            assert not trainer.model.training
            await engine.generate([3, 4], 2)
        assert fake.modes and not any(fake.modes)
        assert fake.events.count("resume") == 2
    finally:
        engine.close()
        trainer.close()


@pytest.mark.parametrize("graphs", [False, True], ids=["recompute", "graphs"])
@pytest.mark.parametrize("keeps_cache", [False, True])
async def test_a_stand_down_that_keeps_the_kv_cache_fails_the_handoff_check(
    monkeypatch: pytest.MonkeyPatch, keeps_cache: bool, graphs: bool
) -> None:
    engine, trainer, _ = _backend(monkeypatch, keeps_cache=keeps_cache, graphs=graphs)
    gate = EngineGate(engine, DeadlineClock(MonotonicTime()), checks=trainer)
    try:
        assert engine.memory_in_use() == KV_BYTES  # serving: the cache is held
        if keeps_cache:
            with pytest.raises(HandoffMismatch) as raised:
                await gate.step(lambda: trainer.train_step(_groups()))
            assert str(raised.value) == (
                f"the engine still holds {KV_BYTES} bytes after standing down (expected 0)"
            )
            assert trainer.completed_steps == 0  # nothing trained beside the held cache
        else:
            await gate.step(lambda: trainer.train_step(_groups()))
            assert gate.statistics().engine_memory_after_stand_down == 0
            assert trainer.completed_steps == 1
    finally:
        engine.close()
        trainer.close()


async def test_partial_rollouts_freeze_a_request_through_the_step_and_continue_it_on_the_new_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`rollout.partial` as the builder wires it: megatron's engine in recompute mode, the gate
    standing it down with a request in flight (no drain), the forward megatron launched for the
    next token dropped before the suspend; after the wake the request continues on the step's
    weights, and its stretches map through the gate to versions 0 and 1."""
    made: list[ModelEngine] = []

    def engine_on_cpu(model, inference, *, tokens, seed, device, graphs, sampler, attention):
        assert inference.kv_cache_management_mode is KVCacheManagementMode.RECOMPUTE
        made.append(ModelEngine(model, length=2, hold_after_steps=1, recompute=True))
        return made[-1]

    monkeypatch.setattr(serve, "dynamic_engine", engine_on_cpu)
    engine, trainer = build_backend(_on_cpu(partial=True), vocab_size=16, stop_ids=[1])
    (fake,) = made
    gate = EngineGate(engine, DeadlineClock(MonotonicTime()))
    try:
        assert gate.partial
        request = asyncio.ensure_future(engine.generate([3, 4], 1))
        await asyncio.to_thread(fake.wait_steps, 1)
        built = fake.seen[0]

        async def train() -> Any:
            assert not fake.controller._async_sched_logits.is_valid  # dropped before the suspend
            fake.release()  # steps again once woken
            return await trainer.train_step(_groups())

        await gate.step(train)
        (completion,) = await request
    finally:
        engine.close()
        trainer.close()
    assert [gate.version_after(wakes) for _, wakes in completion.segments] == [0, 1]
    assert completion.reprefilled_tokens == 2 + 1
    assert not torch.equal(fake.seen[1], built)
    assert torch.equal(fake.seen[1], trainer.model.embedding.word_embeddings.weight)
    assert fake.events[:6] == ["add 0", "step", "suspend", "resume", "recompute 0", "step"]
