"""The decode step's compiled parts on a GPU: inductor's combo kernels run a part's independent
pointwise kernels (the queries' and the keys' rotations) as one launch."""

from __future__ import annotations

import pytest
import torch

from backends.torch import decode_step
from backends.torch.config import ModelConfig
from backends.torch.decode_step import DecodeSteps
from backends.torch.kv_cache import KVCache
from backends.torch.kv_pool import make_pool
from backends.torch.model import Decoder

pytestmark = pytest.mark.gpu

LAYERS, ROWS, LENGTH = 3, 8, 64


def _inductor_kernels(options: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> int:
    """Inductor's kernels in one eager decode step of a bf16 model over a float32 residual
    stream (the bench recipes' precision), its parts compiled with ``options``."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(decode_step, "COMPILE_OPTIONS", options)
    torch._dynamo.reset()  # parts compiled by earlier tests (other options) are not reused
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,
        max_position_embeddings=LENGTH,
    )
    model = Decoder(config).to(device="cuda", dtype=torch.bfloat16).eval()
    model.residual_dtype = torch.float32
    cache = KVCache(config, torch.bfloat16, make_pool(torch.device("cuda")), zero_fresh=True)
    cache.grow(ROWS, LENGTH)
    steps = DecodeSteps(model, cache, graphs=False, flash=True, compiled=True, eager_rounding=False)
    step = steps.get(ROWS, draws=True)
    step.position.copy_(torch.arange(ROWS) * 5)
    step.token.copy_(torch.arange(ROWS) + 3)
    with torch.inference_mode():
        for _ in range(2):  # compiles
            steps.run(step, LENGTH)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            steps.run(step, LENGTH)
            torch.cuda.synchronize()
    return sum(
        1
        for event in prof.events()
        if event.device_type == torch.autograd.DeviceType.CUDA and event.name.startswith("triton_")
    )


def test_combo_kernels_launch_one_kernel_fewer_a_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    combined = _inductor_kernels(decode_step.COMPILE_OPTIONS, monkeypatch)
    apart = _inductor_kernels({}, monkeypatch)
    assert combined <= apart - (LAYERS - 1), (combined, apart)
