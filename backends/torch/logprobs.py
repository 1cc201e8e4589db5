"""Log-probabilities of chosen tokens through the output projection, without float32 logits.

`picked_logprobs(hidden, weight, targets, temperature)` returns
log_softmax(hidden @ weight.T / temperature)[targets] in float32. The forward pass works in row
chunks, each chunk's float32 softmax work done on the fly, so float32 logits for a whole batch
(0.6 MB a token with a 152k vocabulary: 10 GB for a 16 x 1024 micro-batch) never exist.

When gradients are wanted, the forward pass also keeps the softmax's gradient factor
(onehot(target) - softmax(logits / T)) / T in the logits' dtype (2 bytes a vocabulary entry in
bf16, as the logits Hugging Face models keep; about a tenth of a 1.5B model's saved activations
a token). The backward pass is then two GEMMs, with the incoming per-token gradient folded into
their thin operands: grad_hidden = (F @ W) * g and grad_W = F.T @ (g * hidden). Keeping F
instead of recomputing the logits saves one output projection (about 5% of a 1.5B model's
training FLOPs) and a float32 pass over every chunk.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

# Float32 logits materialised at once per chunk (512 MiB).
_CHUNK_ELEMENTS = 1 << 27


def _rows(vocab: int) -> int:
    return max(1, _CHUNK_ELEMENTS // vocab)


def _chunks(n: int, rows: int) -> list[slice]:
    """Row ranges covering 0..n of ``rows`` rows each, the last one shorter, except that a last
    range of one row joins the one before: compiled (`_on`), a chunk of one row would compile a
    graph of its own, dynamo specialising sizes 0 and 1 (a micro-batch of 883k + 1 tokens with
    Qwen's vocabulary, a train step's seconds)."""
    starts = list(range(0, n, rows))
    if len(starts) > 1 and n - starts[-1] == 1:
        starts.pop()
    return [slice(start, end) for start, end in zip(starts, [*starts[1:], n], strict=True)]


def _chunk_stats(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """(logsumexp, logit at target) of a chunk of logits [R, V] / temperature, in float32."""
    scaled = logits.float() / temperature
    return torch.logsumexp(scaled, dim=-1), scaled.gather(-1, targets[:, None]).squeeze(-1)


def _chunk_stats_and_factor(
    logits: Tensor, targets: Tensor, temperature: float, factor: Tensor
) -> tuple[Tensor, Tensor]:
    """`_chunk_stats`, and d(picked - lse)/dlogits = (onehot(target) - softmax) / temperature
    written to ``factor`` (the logits' dtype)."""
    lse, picked = _chunk_stats(logits, targets, temperature)
    onehot = torch.arange(logits.shape[-1], device=logits.device) == targets[:, None]
    # In place on a fresh float32 chunk where eager (CPU); compiled, the ops fuse into one kernel.
    probs = (logits.float() / temperature).sub_(lse[:, None]).exp_()
    factor.copy_(probs.neg_().add_(onehot).div_(temperature))
    return lse, picked


# On CUDA each chunk's float32 work runs as one fused kernel (torch.compile): a chunk's logits
# are read once or twice instead of the half-dozen passes of eager ops over 0.5 GB.
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
    def forward(
        ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, keep: bool
    ) -> Tensor:
        rows = _rows(weight.shape[0])
        picked = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(picked)
        factor = None
        if keep:
            factor = torch.empty(hidden.shape[0], weight.shape[0], dtype=hidden.dtype, device=hidden.device)
            stats = _on(hidden.device, "stats_and_factor", _chunk_stats_and_factor)
        else:
            stats = _on(hidden.device, "stats", _chunk_stats)
        for part in _chunks(hidden.shape[0], rows):
            extra = () if factor is None else (factor[part],)
            lse[part], picked[part] = stats(hidden[part] @ weight.T, targets[part], temperature, *extra)
        if factor is not None:
            ctx.save_for_backward(hidden, weight, factor)
        return picked - lse

    @staticmethod
    @once_differentiable  # the kept factor has no graph of its own: no double backward
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        hidden, weight, factor = ctx.saved_tensors
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_hidden = ((factor @ weight) * grad[:, None]).to(hidden.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = factor.T @ (hidden * grad[:, None]).to(hidden.dtype)
        return grad_hidden, grad_weight, None, None, None


def picked_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """float32 [..] log_softmax(hidden @ weight.T / temperature) at `targets` (hidden [.., H])."""
    shape = targets.shape
    flat = hidden.reshape(-1, hidden.shape[-1])
    if flat.shape[0] == 0:
        return flat.new_zeros(shape, dtype=torch.float32)
    keep = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _PickedLogprobs.apply(flat, weight, targets.reshape(-1), temperature, keep).view(shape)
