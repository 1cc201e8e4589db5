"""The decode step's own loop over the layers (`backends/torch/decode_step.py`): where the residual
stream is float32 one part runs from a layer's attention output to the next layer's projections
(`_between`), and the step computes what separate finish and project parts compute; in a
half-precision stream the parts stay separate (the trainer's and the prefill's round between
them)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from backends.torch.config import ModelConfig
from backends.torch.decode_step import DecodeSteps
from backends.torch.kv_cache import KVCache
from backends.torch.kv_pool import PlainPool
from backends.torch.model import Decoder

LAYERS, LENGTH, POSITIONS = 3, 32, [5, 0, 17]


def _steps(dtype: torch.dtype, residual: torch.dtype | None) -> DecodeSteps:
    torch.manual_seed(0)
    shape = {"hidden_size": 32, "intermediate_size": 64, "max_position_embeddings": 64}
    config = ModelConfig(vocab_size=40, num_hidden_layers=LAYERS, **shape)
    model = Decoder(config).to(dtype).eval()
    model.residual_dtype = residual
    cache = KVCache(config, dtype, PlainPool(torch.device("cpu")), zero_fresh=True)
    cache.grow(len(POSITIONS), LENGTH)
    cache.every.copy_(torch.randn_like(cache.every, dtype=torch.float32).to(dtype))
    return DecodeSteps(model, cache, graphs=False, flash=False, compiled=False, eager_rounding=False)


def _run(steps: DecodeSteps) -> tuple[torch.Tensor, dict[str, int]]:
    """One step's logits, and how often each layer part ran."""
    calls = {"between": 0, "finish": 0, "project": 0}
    for name in calls:
        part = getattr(steps, f"_{name}")

        def counted(*args: Any, part: Any = part, name: str = name) -> Any:
            calls[name] += 1
            return part(*args)

        setattr(steps, f"_{name}", counted)
    step = steps.get(len(POSITIONS), draws=False)
    step.token.copy_(torch.tensor([3, 8, 1]))
    step.position.copy_(torch.tensor(POSITIONS))
    with torch.no_grad():
        steps.run(step, LENGTH)
    return step.logits.clone(), calls


@pytest.mark.parametrize(
    ("dtype", "residual", "fused"),
    [(torch.float32, None, True), (torch.bfloat16, torch.float32, True), (torch.bfloat16, None, False)],
    ids=["float32", "bf16-float32-residual", "bf16"],
)
def test_a_float32_residual_stream_runs_one_part_between_two_layers_attentions(
    dtype: torch.dtype, residual: torch.dtype | None, fused: bool
) -> None:
    steps = _steps(dtype, residual)
    assert steps.fused is fused
    _, calls = _run(steps)
    if fused:
        assert calls == {"between": LAYERS - 1, "finish": 1, "project": 1}
    else:
        assert calls == {"between": 0, "finish": LAYERS, "project": LAYERS}


def test_the_joined_parts_give_the_separate_parts_logits() -> None:
    """Each layer's attention, writes and parts line up: the step through `_between` gives the
    logits of the same step through separate parts, bit for bit (eager, float32)."""
    joined, _ = _run(_steps(torch.float32, None))
    apart = _steps(torch.float32, None)
    apart.fused = False
    separate, calls = _run(apart)
    assert calls["between"] == 0
    assert torch.equal(joined, separate)
