"""Episodes' keys and values kept between turns (backends/torch/kv_keep.py) on a GPU: the real
engine under CUDA graphs, its decode attention and compiled parts, with more episodes than slots so
turns enter the loop in slots freed mid-loop, restored there between two graph replays."""

from __future__ import annotations

import anyio
import pytest
import torch

from backends.torch.engine import TorchEngine
from backends.torch.model import Decoder
from backends.torch.sampler import Sampler
from pipeline.algorithms.losses import mismatch_metrics
from pipeline.contracts.messages import Completion
from tests.gpu.test_sampler import _model, _prompts, _recomputed

pytestmark = pytest.mark.gpu

EPISODES, TURNS, NEW = 12, 3, 40  # 40 new tokens: past the loop's first check (every 32 steps)


def _engine(model: Decoder, keep_bytes: int) -> TorchEngine:
    return TorchEngine(
        Sampler(model),
        shared=True,
        source=model,
        max_new_tokens=NEW,
        temperature=1.0,
        top_p=1.0,
        stop_token_ids=(),
        seed=0,
        max_rows=8,  # fewer slots than episodes: turns enter as others' rows finish
        keep_bytes=keep_bytes,
    )


async def _play(engine: TorchEngine, greedy: bool) -> list[list[tuple[list[int], Completion]]]:
    """EPISODES concurrent episodes of TURNS turns, each turn's reply three tokens of its own;
    every turn's context and completion."""
    played: list[list[tuple[list[int], Completion]]] = [[] for _ in range(EPISODES)]

    async def episode(i: int, prompt: list[int]) -> None:
        context = prompt
        for turn in range(TURNS):
            (completion,) = await engine.generate(context, 1, greedy=greedy, episode=f"e{i}")
            played[i].append((context, completion))
            context = [*context, *completion.tokens, 7 + turn, 8 + i, 9]
        engine.end_episode(f"e{i}")

    try:
        with anyio.fail_after(300):
            async with anyio.create_task_group() as tg:
                for i, prompt in enumerate(_prompts(EPISODES, seed=3)):
                    tg.start_soon(episode, i, prompt)
    finally:
        engine.close()
    return played


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
async def test_turns_continue_from_kept_keys_and_values_under_graphs(dtype: torch.dtype) -> None:
    """Every turn after the first reuses what the episode's last turn kept. Greedy in float32,
    the tokens equal an engine that prefills every context whole, and the logprobs a full
    recomputation's; sampled in bf16, the logprobs agree with a full recomputation as a
    single-turn sampler's do (tests/gpu/test_sampler.py)."""
    model = _model(dtype)
    greedy = dtype == torch.float32
    kept = await _play(_engine(model, 1 << 30), greedy)
    assert all(c.reused_tokens == len(context) - 4 for turns in kept for context, c in turns[1:])
    turns = [pair for episode in kept for pair in episode]
    lp, gen, mask = _recomputed(model, [context for context, _ in turns], [c for _, c in turns], 1.0)
    if greedy:
        whole = await _play(_engine(model, 0), greedy)
        assert [[c.tokens for _, c in e] for e in kept] == [[c.tokens for _, c in e] for e in whole]
        torch.testing.assert_close(gen * mask, lp * mask, atol=2e-4, rtol=0)
    else:
        metrics = mismatch_metrics(lp, gen, mask)
        assert metrics["train/token_mult_prob_error"] < 1.01, metrics
        assert metrics["train/gen_kl_error"] < 1e-3, metrics
