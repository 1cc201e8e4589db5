"""Handoff checks on a GPU: the Triton fingerprint kernel agrees with the torch path, and a
corrupted weight is caught after a wake and after a refit."""

from __future__ import annotations

import anyio
import pytest
import torch

from backends.torch.config import ModelConfig
from backends.torch.engine import TorchEngine
from backends.torch.fingerprint import Fingerprinter, checksum, parameter_probes
from backends.torch.model import Decoder
from backends.torch.sampler import Sampler

pytestmark = pytest.mark.gpu


def _model(dtype: torch.dtype) -> Decoder:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        attention_bias=True,
    )
    return Decoder(config).to(device="cuda", dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_torch_path(dtype: torch.dtype) -> None:
    probes = parameter_probes(_model(dtype).named_parameters())
    on_gpu = Fingerprinter(probes)()
    assert on_gpu == {p.name: checksum(p.base[p.indices]) for p in probes}


def _engine(model: Decoder, shared: bool) -> TorchEngine:
    dtype = next(model.parameters()).dtype
    engine_model = model if shared else Decoder(model.config).to(device="cuda", dtype=dtype)
    return TorchEngine(
        Sampler(engine_model),
        shared=shared,
        source=model,
        max_new_tokens=8,
        temperature=1.0,
        top_p=1.0,
        stop_token_ids=(),
        seed=0,
        fingerprints=True,
    )


@pytest.mark.parametrize("shared", [True, False], ids=["colocated-wake", "separate-refit"])
def test_a_corrupted_weight_is_caught_at_the_handoff(shared: bool) -> None:
    """The engine's fingerprint, taken at its wake (colocated) or refit (separate), equals the
    trainer's; a row of the weights the engine serves corrupted (the shared model's, or the
    separate engine's own model's) shows in that tensor's fingerprint and no other."""
    model = _model(torch.bfloat16)
    published = Fingerprinter(parameter_probes(model.named_parameters()))
    engine = _engine(model, shared)

    async def handoff() -> dict[str, int]:
        await engine.generate([5, 6, 7], 4)
        if shared:
            await engine.stand_down()
            await engine.wake()
        else:
            await engine.refit()
        served = engine.fingerprint()
        assert served is not None
        return served

    try:
        assert anyio.run(handoff) == published()
        expected = published()
        with torch.no_grad():  # what the graphs read: the engine model's fused gate/up
            engine.sampler.model.model.layers[1].mlp.gate_up_proj.weight[7].mul_(-1)
        engine._take_fingerprint()
        served = engine.fingerprint()
        assert served is not None
        assert [name for name in expected if expected[name] != served[name]] == [
            "model.layers.1.mlp.gate_up_proj.weight"
        ]
    finally:
        engine.close()
