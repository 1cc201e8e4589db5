"""Weight fingerprints: the engine's view of its packed copies equals the trainer's view of its
parameters, and a stale or corrupted tensor shows, named."""

from __future__ import annotations

import pytest
import torch

from backends.torch.config import ModelConfig
from backends.torch.cuda_sampler import CudaSampler
from backends.torch.fingerprint import Fingerprinter, checksum, parameter_probe, parameter_probes, sample_rows
from backends.torch.model import Decoder


def _model(qwen3: bool = False) -> Decoder:
    """Qwen2-shaped, or with `qwen3` Qwen3-shaped (q/k norms, which the sampler reads from the
    model itself, and no biases)."""
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=37,
        hidden_size=48,
        intermediate_size=80,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        attention_bias=not qwen3,
        qk_norm=qwen3,
    )
    return Decoder(config)


def _trainer_view(model: Decoder) -> dict[str, int]:
    return Fingerprinter(parameter_probes(model.named_parameters()))()


def _served(sampler: CudaSampler) -> dict[str, int]:
    return Fingerprinter(sampler.probes())()


def _differing(a: dict[str, int], b: dict[str, int]) -> list[str]:
    assert a.keys() == b.keys()
    return [name for name in a if a[name] != b[name]]


@pytest.mark.parametrize("qwen3", [False, True], ids=["qwen2", "qwen3"])
@pytest.mark.parametrize("flash_order", [False, True], ids=["model-order", "flash-order"])
def test_packed_copies_fingerprint_as_the_model_and_a_stale_tensor_shows(
    flash_order: bool, qwen3: bool
) -> None:
    """Every parameter is probed where the sampler reads it (its packed copies for q/k/v, o,
    gate/up, with flash's query-head order too), so the fingerprints equal the trainer's; a
    weight changed without `refresh`, or a corrupted packed row, names its tensor."""
    model = _model(qwen3)
    sampler = CudaSampler(model)
    sampler.generate([[1, 2, 3]], max_new_tokens=2, temperature=0.0, generator=torch.Generator())
    if flash_order:  # the layout a GPU uses (queries in [g, kv_heads] order); no attention runs
        sampler.flash = True
        sampler.refresh()
    assert _differing(_trainer_view(model), _served(sampler)) == []
    assert ("model.layers.1.self_attn.q_norm.weight" in _served(sampler)) == qwen3
    q = model.model.layers[1].self_attn.q_proj.weight
    column = int(sample_rows(q.shape, q.device)[1][13])  # the element row 13 is sampled at
    with torch.no_grad():
        q[13, column] += 1.0
    assert _differing(_trainer_view(model), _served(sampler)) == ["model.layers.1.self_attn.q_proj.weight"]
    sampler.refresh()
    assert _differing(_trainer_view(model), _served(sampler)) == []
    with torch.no_grad():
        sampler._packed[0].gate_up_weight[80 + 3].mul_(2)  # up_proj's row 3 in the packed copy
    assert _differing(_trainer_view(model), _served(sampler)) == ["model.layers.0.mlp.up_proj.weight"]


def test_checksum_sees_a_changed_row_and_swapped_rows() -> None:
    weight = torch.randn(64, 32)
    before = Fingerprinter([parameter_probe("w", weight)])()["w"]
    swapped = weight[[1, 0, *range(2, 64)]].contiguous()
    assert Fingerprinter([parameter_probe("w", swapped)])()["w"] != before
    weight[40].add_(0.5)  # a whole row, as a missed copy of a shard would leave it
    assert Fingerprinter([parameter_probe("w", weight)])()["w"] != before
    # bf16 values are checksummed by their bits, exactly.
    values = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    assert checksum(values) == 0x3F80 * 1 + (0xC000 - 0x10000) * 3
