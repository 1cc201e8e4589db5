"""The CPU case of the sampler's split-key decode step (`backends/torch/decode_step.py` attending
by `paged_decode` over the `KVCache` seen as blocks): `python -m tests.backends.decode_split_case`
with TRITON_INTERPRET=1 (it must be on before Triton is first imported, so the test runs it in a
process of its own) prints one JSON object: for each model shape the largest difference of a
step's logits by `paged_decode` from the same step attending by `attend` with a length mask,
and how many of its layers went through the kernel: with each row's keys split in 4 (as a GPU
splits them; `paged_decode.splits` is made to answer 4) and unsplit (its answer off CUDA, 1, as
for a batch wide enough to fill a GPU alone: such a step attends by the kernel too).

Float32 (Triton's interpreter gets `tl.dot` of bf16 tiles wrong). Rows at different positions
(one at 0, as a bucket's padding rows are), more keys than one split's share, GQA, and a Qwen3
shape (head_dim other than hidden / heads).
"""

from __future__ import annotations

import itertools
import json

import torch

from backends.torch import paged_decode
from backends.torch.config import ModelConfig
from backends.torch.decode_step import DecodeSteps
from backends.torch.kv_cache import KVCache
from backends.torch.kv_pool import PlainPool
from backends.torch.model import Decoder

# name: (heads, KV heads, head dim, qk_norm)
SHAPES: dict[str, tuple[int, int, int, bool]] = {
    "qwen2_group_2": (4, 2, 16, False),
    "qwen3_head_dim_32_group_3": (6, 2, 32, True),
}
POSITIONS = [70, 0, 33, 129]  # each row's new token's position (its keys: position + 1)
LENGTH = 160


def _logits(model: Decoder, cache: KVCache, flash: bool, saved: torch.Tensor) -> torch.Tensor:
    cache.every.copy_(saved)  # the same earlier keys and values for both paths
    steps = DecodeSteps(model, cache, graphs=False, flash=flash, compiled=False, eager_rounding=False)
    step = steps.get(len(POSITIONS), draws=False)
    step.token.copy_(torch.tensor([5, 9, 2, 7]))
    step.position.copy_(torch.tensor(POSITIONS))
    steps.run(step, LENGTH)
    return step.logits.clone()


def main() -> dict[str, dict[str, float]]:
    splits, attend, calls = paged_decode.splits, paged_decode.attend, []

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return attend(*args, **kwargs)

    paged_decode.attend = counted  # type: ignore[assignment]
    out: dict[str, dict[str, float]] = {"errors": {}, "calls": {}}
    for (name, (heads, kv_heads, head_dim, qk_norm)), split in itertools.product(SHAPES.items(), (4, 1)):
        paged_decode.splits = lambda programs, width, device, n=split: n  # type: ignore[misc]
        key = f"{name}_splits_{split}"
        calls.clear()
        torch.manual_seed(0)
        config = ModelConfig(
            vocab_size=50,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            qk_norm=qk_norm,
            max_position_embeddings=LENGTH,
        )
        model = Decoder(config).eval()
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(20)
        cache = KVCache(config, torch.float32, PlainPool(torch.device("cpu")), zero_fresh=True)
        cache.grow(len(POSITIONS) + 2, LENGTH)
        saved = torch.randn_like(cache.every)
        with torch.no_grad():
            split = _logits(model, cache, True, saved)
            masked = _logits(model, cache, False, saved)
        out["errors"][key] = float((split - masked).abs().max() / masked.abs().max())
        out["calls"][key] = len(calls)
    paged_decode.splits = splits  # type: ignore[assignment]
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
