"""The trainer's GPU kernels: the logprob head's compiled chunk functions and the compiled
layer parts of `train.compile`, against plain computation."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from backends.torch.compiles import compiled_graphs
from backends.torch.config import ModelConfig
from backends.torch.grouped import response_logprobs
from backends.torch.logprobs import picked_logprobs
from backends.torch.model import Decoder, compiled_layer_parts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_head_values_and_gradients_on_cuda(temperature: float) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(300, 64, device="cuda", requires_grad=True)
    weight = torch.randn(5000, 64, device="cuda", requires_grad=True)
    targets = torch.randint(0, 5000, (300,), device="cuda")
    upstream = torch.randn(300, device="cuda")
    ours = picked_logprobs(hidden, weight, targets, temperature)
    (ours * upstream).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    reference = torch.log_softmax(hidden @ weight.T / temperature, -1).gather(-1, targets[:, None])[:, 0]
    (reference * upstream).sum().backward()
    torch.testing.assert_close(ours, reference, atol=2e-4, rtol=0)
    torch.testing.assert_close(grads[0], hidden.grad, atol=2e-4, rtol=1e-3)
    torch.testing.assert_close(grads[1], weight.grad, atol=2e-4, rtol=1e-3)


class _Batch(NamedTuple):
    """A bf16 model with grouped-query attention and groups whose prompts are padded (12 and 30
    tokens) and whose responses differ in length."""

    model: Decoder
    prompts: list[tuple[int, ...]]
    owner: list[int]
    responses: list[tuple[int, ...]]

    def run(self, **options: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The trainer pass's logprobs and the flattened gradient of their sum."""
        self.model.zero_grad()
        lp, mask = response_logprobs(self.model, self.prompts, self.owner, self.responses, 1.0, **options)
        (lp * mask).sum().backward()
        return lp.detach(), torch.cat([p.grad.float().flatten() for p in self.model.parameters()])


def _batch() -> _Batch:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,
    )
    g = torch.Generator().manual_seed(0)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(3, 1000, (n,), generator=g).tolist())

    return _Batch(
        Decoder(config).to(device="cuda", dtype=torch.bfloat16),
        [tokens(n) for n in (12, 30)],
        [0, 0, 0, 1, 1, 1],
        [tokens(n) for n in (5, 40, 17, 1, 33, 8)],
    )


def _assert_bf16_close(
    ours: tuple[torch.Tensor, torch.Tensor], reference: tuple[torch.Tensor, torch.Tensor]
) -> None:
    # bf16: different kernels round at different places.
    torch.testing.assert_close(ours[0], reference[0], atol=0.05, rtol=0)
    assert float((ours[1] - reference[1]).norm() / reference[1].norm()) < 0.02


def test_compiled_trainer_pass_matches_plain_in_bf16() -> None:
    batch = _batch()
    plain = batch.run()
    for options in ({"compiled": True}, {"compiled": True, "checkpointed": True}):
        _assert_bf16_close(batch.run(**options), plain)


@pytest.mark.parametrize("residual", [None, torch.float32], ids=["bf16-residual", "float32-residual"])
def test_responses_flash_attention_matches_the_masked_path_in_bf16(
    monkeypatch: pytest.MonkeyPatch, residual: torch.dtype | None
) -> None:
    """bf16 layers attend through flash whatever the residual stream's dtype (the H200
    recipes' `model.residual: float32` included), and give the masked path's figures."""
    from backends.torch import grouped

    batch = _batch()
    batch.model.residual_dtype = residual
    calls = []
    attend = grouped._flash_attend
    monkeypatch.setattr(grouped, "_flash_attend", lambda *a: calls.append(1) or attend(*a))
    flash = batch.run()
    assert calls, "the responses' attention did not run through flash"
    monkeypatch.setattr(grouped, "_flash_usable", lambda *a: False)
    _assert_bf16_close(flash, batch.run())


def test_compiled_layer_parts_take_fewer_tokens_without_compiling_again() -> None:
    """`train.compile`'s layer parts, forward and backward in bf16 over 6,000 then 7,000 tokens
    (the second compiles them for any token count), then 1,000 tokens: nothing compiles for the
    third (inductor's mix-order reduction, on, guards the parts on at least 4,096 tokens)."""
    torch._dynamo.reset()  # the parts' first compiles here, whatever compiled them before
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=64,
        hidden_size=1536,
        intermediate_size=2048,
        num_hidden_layers=1,
        num_attention_heads=12,
        num_key_value_heads=2,
    )
    model = Decoder(config).to("cuda", torch.bfloat16)
    layer = model.model.layers[0]
    project, finish = compiled_layer_parts()

    def step(tokens: int) -> None:
        x = torch.randn(tokens, config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        cos, sin = model.rotary(torch.arange(tokens, device="cuda"))
        q, _, _ = project(layer, x, cos, sin)
        finish(layer, x, q.flatten(-2)).float().square().mean().backward()

    step(6000)
    step(7000)
    compiled = compiled_graphs()
    step(1000)
    assert compiled_graphs() == compiled
