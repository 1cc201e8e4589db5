"""Log-probabilities of chosen tokens through the output projection, without keeping logits.

`picked_logprobs(hidden, weight, targets, temperature)` returns
log_softmax(hidden @ weight.T / temperature)[targets] in float32. The forward pass works in row
chunks and keeps only each row's logsumexp; the backward pass recomputes each chunk's logits.
With a 152k vocabulary, keeping float32 logits for autograd would hold ~0.6 MB per token (10 GB
for a 16 x 1024 micro-batch) and force tiny chunks; recomputing costs one extra output
projection, about 5% of a 1.5B model's training FLOPs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

# Float32 logits materialised at once per chunk (512 MiB).
_CHUNK_ELEMENTS = 1 << 27


def _rows(vocab: int) -> int:
    return max(1, _CHUNK_ELEMENTS // vocab)


def _chunk_stats(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """(logsumexp, logit at target) of a chunk of logits [R, V] / temperature, in float32."""
    scaled = logits.float() / temperature
    return torch.logsumexp(scaled, dim=-1), scaled.gather(-1, targets[:, None]).squeeze(-1)


def _chunk_grad(logits: Tensor, lse: Tensor, grad: Tensor, targets: Tensor, temperature: float) -> Tensor:
    """d(picked - lse)/dlogits = (onehot(target) - softmax) / temperature, times the incoming
    grad, in the logits' dtype."""
    # In place on the fresh `scaled`: eagerly (CPU) one float32 chunk and a bool one-hot are
    # all that is allocated; compiled, the same ops fuse into one kernel.
    onehot = torch.arange(logits.shape[-1], device=logits.device) == targets[:, None]
    probs = (logits.float() / temperature).sub_(lse[:, None]).exp_()
    return probs.neg_().add_(onehot).mul_(grad[:, None]).div_(temperature).to(logits.dtype)


# On CUDA each chunk's float32 work runs as one fused kernel (torch.compile): a chunk's logits
# are read once instead of the half-dozen passes of eager ops over 0.5 GB.
_fused: dict[str, Any] = {}


def _on(device: torch.device, name: str, fn: Any) -> Any:
    if device.type != "cuda":
        return fn
    if name not in _fused:
        # Not fullgraph: past dynamo's recompile limit (many temperatures, dtypes) a chunk
        # runs eagerly instead of failing the step.
        _fused[name] = torch.compile(fn)
    return _fused[name]


class _PickedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float) -> Tensor:
        rows = _rows(weight.shape[0])
        stats = _on(hidden.device, "stats", _chunk_stats)
        picked = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(picked)
        for i in range(0, hidden.shape[0], rows):
            logits = hidden[i : i + rows] @ weight.T
            lse[i : i + rows], picked[i : i + rows] = stats(logits, targets[i : i + rows], temperature)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature = temperature
        return picked - lse

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        hidden, weight, targets, lse = ctx.saved_tensors
        rows = _rows(weight.shape[0])
        chunk_grad = _on(hidden.device, "grad", _chunk_grad)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for i in range(0, hidden.shape[0], rows):
            chunk = hidden[i : i + rows]
            logits = chunk @ weight.T
            dlogits = chunk_grad(
                logits, lse[i : i + rows], grad[i : i + rows], targets[i : i + rows], ctx.temperature
            )
            if grad_hidden is not None:
                grad_hidden[i : i + rows] = dlogits @ weight
            grad_weight += (dlogits.T @ chunk).float()
        return grad_hidden, grad_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None, None, None


def picked_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """float32 [..] log_softmax(hidden @ weight.T / temperature) at `targets` (hidden [.., H])."""
    shape = targets.shape
    flat = hidden.reshape(-1, hidden.shape[-1])
    if flat.shape[0] == 0:
        return flat.new_zeros(shape, dtype=torch.float32)
    return _PickedLogprobs.apply(flat, weight, targets.reshape(-1), temperature).view(shape)
