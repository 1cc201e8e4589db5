"""The trainer's GPU kernels: the logprob head's compiled chunk functions and the compiled
layer parts of `train.compile`, against plain computation."""

from __future__ import annotations

import pytest
import torch

from backends.torch.config import ModelConfig
from backends.torch.grouped import response_logprobs
from backends.torch.logprobs import picked_logprobs
from backends.torch.model import Decoder

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


def test_compiled_trainer_pass_matches_plain_in_bf16() -> None:
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
    model = Decoder(config).to(device="cuda", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    prompts = [tuple(torch.randint(3, 1000, (n,), generator=g).tolist()) for n in (12, 30)]
    owner = [0, 0, 0, 1, 1, 1]
    responses = [tuple(torch.randint(3, 1000, (n,), generator=g).tolist()) for n in (5, 40, 17, 1, 33, 8)]

    def run(**kw: bool) -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad()
        lp, mask = response_logprobs(model, prompts, owner, responses, 1.0, **kw)
        (lp * mask).sum().backward()
        grad = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        return lp.detach(), grad

    plain, plain_grad = run()
    for options in ({"compiled": True}, {"compiled": True, "checkpointed": True}):
        ours, grad = run(**options)
        # bf16: fused kernels round at other places than eager ops.
        torch.testing.assert_close(ours, plain, atol=0.05, rtol=0)
        assert float((grad - plain_grad).norm() / plain_grad.norm()) < 0.02, options


def test_responses_flash_attention_matches_the_masked_path_in_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    from backends.torch import grouped

    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    model = Decoder(config).to(device="cuda", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    prompts = [tuple(torch.randint(3, 1000, (n,), generator=g).tolist()) for n in (9, 30, 17)]  # padded
    owner = [0, 0, 1, 1, 1, 2]
    responses = [tuple(torch.randint(3, 1000, (n,), generator=g).tolist()) for n in (5, 60, 17, 1, 33, 8)]

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad()
        lp, mask = response_logprobs(model, prompts, owner, responses, 1.0)
        (lp * mask).sum().backward()
        return lp.detach(), torch.cat([p.grad.float().flatten() for p in model.parameters()])

    flash, flash_grad = run()
    monkeypatch.setattr(grouped, "_flash_usable", lambda x: False)
    masked, masked_grad = run()
    torch.testing.assert_close(flash, masked, atol=0.05, rtol=0)
    assert float((flash_grad - masked_grad).norm() / masked_grad.norm()) < 0.02
