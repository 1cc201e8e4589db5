"""Chunked, recomputing logprobs equal the plain log_softmax, in values and gradients."""

from __future__ import annotations

import pytest
import torch

import backends.torch.logprobs as logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_picked_logprobs_match_log_softmax(monkeypatch: pytest.MonkeyPatch, temperature: float) -> None:
    monkeypatch.setattr(logprobs, "_CHUNK_ELEMENTS", 3 * 50)  # three rows a chunk: several chunks
    torch.manual_seed(0)
    hidden = torch.randn(4, 5, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (4, 5))
    upstream = torch.randn(4, 5, dtype=torch.float64)

    ours = logprobs.picked_logprobs(hidden, weight, targets, temperature)
    (ours * upstream).sum().backward()
    ours_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad, weight.grad = None, None

    logits = (hidden @ weight.T).float() / temperature
    reference = torch.log_softmax(logits, -1).gather(-1, targets[..., None])
    (reference.squeeze(-1) * upstream).sum().backward()
    torch.testing.assert_close(ours, reference.squeeze(-1).float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_grads[0], hidden.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_grads[1], weight.grad, atol=1e-5, rtol=1e-5)


def test_forward_only_and_gradient_keeping_paths_give_the_same_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(logprobs, "_CHUNK_ELEMENTS", 3 * 50)
    torch.manual_seed(0)
    hidden = torch.randn(7, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (7,))
    with torch.no_grad():
        plain = logprobs.picked_logprobs(hidden, weight, targets)
    kept = logprobs.picked_logprobs(hidden, weight, targets)
    torch.testing.assert_close(plain, kept, atol=0, rtol=0)
