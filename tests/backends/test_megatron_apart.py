"""megatron's engine apart from the trainer (`rollout.engine: megatron`, `colocated: false`), as
the builder wires it, on the CPU: the engine serves a `GPTModel` of its own, the real gate
refits it after each real train step (the trainer's weights copied in, checked against the
trainer's fingerprint), and the engine generates on the copied weights. megatron's dynamic
engine is replaced by a fake over the model it is handed (it needs CUDA:
tests/gpu/test_megatron_gpu.py runs the real one apart)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron.core.inference.utils import InferenceMode  # noqa: E402

from backends.megatron import apart, serve  # noqa: E402
from backends.megatron.build import build_backend  # noqa: E402
from pipeline.clock import DeadlineClock, MonotonicTime  # noqa: E402
from pipeline.contracts.errors import HandoffMismatch  # noqa: E402
from pipeline.gate import EngineGate  # noqa: E402
from tests.backends.test_megatron_serve import _on_cpu  # noqa: E402
from tests.backends.test_megatron_standdown import ModelEngine, _groups  # noqa: E402


def _apart(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, ModelEngine]:
    made: list[ModelEngine] = []

    def engine_on_cpu(model, inference, *, tokens, seed, device, graphs, sampler, attention):
        InferenceMode.set_active()  # as megatron's engine does when built, on its own thread
        made.append(ModelEngine(model, length=2))
        return made[-1]

    monkeypatch.setattr(serve, "dynamic_engine", engine_on_cpu)
    recipe = _on_cpu("colocated=false", "async_rl.handoff_checks=true")
    engine, trainer = build_backend(recipe, vocab_size=16, stop_ids=[1])
    return engine, trainer, made[0]


def _embeddings(model: Any) -> torch.Tensor:
    return model.embedding.word_embeddings.weight.detach().clone()


async def test_the_engine_serves_its_own_copy_refitted_with_each_steps_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine, trainer, fake = _apart(monkeypatch)
    gate = EngineGate(engine, DeadlineClock(MonotonicTime()), checks=trainer)
    try:
        # The engine serving on its thread leaves the trainer's forward out of megatron's
        # inference paths (whose output layer would assert the logits are gathered).
        assert not InferenceMode.is_active()
        assert not engine.blocks_training and not engine.wake_carries_weights
        assert fake.model is not trainer.model
        assert not any(p.requires_grad for p in fake.model.parameters())
        first = _embeddings(trainer.model)
        await engine.generate([3, 4], 1)
        await gate.step(lambda: trainer.train_step(_groups()))  # train, then refit (checked)
        second = _embeddings(trainer.model)
        assert not torch.equal(first, second)
        assert engine.fingerprint() == trainer.fingerprint() is not None
        await engine.generate([3, 4], 1)
    finally:
        engine.close()
        trainer.close()
    # Two steps of each request: the first's on the built weights, the second's on the step's.
    assert [torch.equal(seen, first) for seen in fake.seen] == [True, True, False, False]
    assert all(torch.equal(seen, second) for seen in fake.seen[2:])
    assert gate.statistics().engine_version == 1


async def test_a_refit_that_leaves_the_copy_stale_fails_the_handoff_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(apart.EngineCopy, "refresh", lambda self: None)  # a copy never made
    engine, trainer, _ = _apart(monkeypatch)
    gate = EngineGate(engine, DeadlineClock(MonotonicTime()), checks=trainer)
    try:
        with pytest.raises(
            HandoffMismatch, match="after the refit to version 1 the engine serves weights other"
        ):
            await gate.step(lambda: trainer.train_step(_groups()))
    finally:
        engine.close()
        trainer.close()
