"""Shared by the megatron backend's tests: model shapes of every supported family, groups, and a
CPU build of megatron's distributed optimizer (`cuda_named`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from backends.torch.config import ModelConfig
from pipeline.contracts.messages import TrainGroup, TrainSample

_BASE = dict(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
CONFIGS = {
    # GQA 4 heads over 2 groups, untied, plain rotary.
    "llama": ModelConfig(**_BASE, num_attention_heads=4, num_key_value_heads=2),
    "qwen2-bias": ModelConfig(**_BASE, num_attention_heads=4, num_key_value_heads=2, attention_bias=True),
    "qwen3-qk-norm-tied": ModelConfig(
        **_BASE, num_attention_heads=4, num_key_value_heads=4, qk_norm=True, tie_word_embeddings=True
    ),
    "llama3-scaled-head-dim": ModelConfig(
        **_BASE,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "learned-positions": ModelConfig(
        **_BASE,
        num_attention_heads=4,
        num_key_value_heads=2,
        learned_position_embeddings=True,
        max_position_embeddings=32,
    ),
}


def groups(
    seed: int = 1, vocab: int = 32, length: Callable[[int, int], int] = lambda g, s: 2 + (s * 3 + g) % 5
) -> list[TrainGroup]:
    """Three groups of four samples: prompts and responses of different lengths (sample s of
    group g: `length(g, s)` tokens), behaviour logprobs off the model's (so the IS correction
    and the mismatch metrics have work)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for gi in range(3):
        prompt = torch.randint(0, vocab, (4 + gi,), generator=g).tolist()
        samples = []
        for si in range(4):
            n = length(gi, si)
            samples.append(
                TrainSample(
                    tokens=tuple(torch.randint(0, vocab, (n,), generator=g).tolist()),
                    logprobs=tuple((-torch.rand(n, generator=g) * 3 - 2).tolist()),
                    reward=float(si % 2),
                    advantage=float(si) - 1.5,
                )
            )
        out.append(TrainGroup(group_id=f"g{gi}", prompt_tokens=tuple(prompt), samples=tuple(samples)))
    return out


@contextlib.contextmanager
def cuda_named() -> Iterator[None]:
    """Build megatron's distributed optimizer (`MegatronAdam`) on CPU: while it is built, CPU
    tensors name themselves CUDA tensors (its constructor accepts only those) and a tensor asked
    for on "cuda" lands on the CPU. Its state and checkpoint paths then run on CPU; its step
    does not (megatron's DDP waits on CUDA streams)."""
    tensor, named = torch.tensor, torch.Tensor.type

    def on_cpu(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return tensor(*args, device="cpu" if device == "cuda" else device, **kwargs)

    def cuda_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return named(self, *args, **kwargs)
        return named(self).replace("torch.", "torch.cuda.", 1)

    torch.tensor, torch.Tensor.type = on_cpu, cuda_type  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        torch.tensor, torch.Tensor.type = tensor, named  # type: ignore[method-assign]
