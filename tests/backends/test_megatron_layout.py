"""Hugging Face <-> megatron layouts: exact round trips, at every tensor-parallel size."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from backends.megatron import layout  # noqa: E402
from backends.torch.model import Decoder  # noqa: E402
from tests.backends.megatron_cases import CONFIGS  # noqa: E402


@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_round_trip_is_exact(name: str, size: int) -> None:
    config = CONFIGS[name]
    torch.manual_seed(0)
    hf = Decoder(config).state_dict()
    shards = [layout.to_megatron(hf, config, rank=r, size=size) for r in range(size)]
    back = layout.to_hf(shards, config)
    assert sorted(back) == sorted(hf)
    for key, value in hf.items():
        assert torch.equal(back[key], value), key


def test_qkv_is_fused_by_query_group_and_sharded_by_groups() -> None:
    # 4 query heads over 2 groups, head_dim 16: group g holds q heads 2g, 2g+1, then k g, v g.
    config = CONFIGS["qwen2-bias"]
    hf = {k: v.clone() for k, v in Decoder(config).state_dict().items()}
    at = "model.layers.0.self_attn."
    for i, p in enumerate("qkv"):
        bias = hf[f"{at}{p}_proj.bias"]
        bias.copy_(torch.arange(bias.numel()) // 16 + 10 * i)  # head number, 0/10/20 for q/k/v
    fused = [layout.to_megatron(hf, config, rank=r, size=2) for r in range(2)]
    heads = [s["decoder.layers.0.self_attention.linear_qkv.bias"][::16].tolist() for s in fused]
    assert heads == [[0, 1, 10, 20], [2, 3, 11, 21]]


def test_gate_and_up_are_fused_per_shard() -> None:
    config = CONFIGS["llama"]  # intermediate 96: 48 gate and 48 up rows a rank at size 2
    hf = {k: v.clone() for k, v in Decoder(config).state_dict().items()}
    hf["model.layers.0.mlp.gate_proj.weight"][:] = 1.0
    hf["model.layers.0.mlp.up_proj.weight"][:] = 2.0
    fc1 = layout.to_megatron(hf, config, rank=1, size=2)["decoder.layers.0.mlp.linear_fc1.weight"]
    assert fc1[:, 0].tolist() == [1.0] * 48 + [2.0] * 48
