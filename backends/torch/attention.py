"""Attention as `DecoderLayer` takes it: one object per forward pass, called by every layer.

A `LayerAttention` sees each layer's rotated queries and keys and its values and returns
attention's output; it owns the layout of the pass (which tokens see which keys, where cached
keys live). The implementations: `CausalAttention` here (batches of rows, causal, optional key
masks: the model's plain forward), the prompt-shared training layout (`grouped.py`), and the
sampler's prefill and decode over its KV pool. `attend` is the kernel choice they share on
[B, H, T, D] tensors: on CPU for short sequences softmax(QK^T)V written out, else SDPA.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


class LayerAttention(Protocol):
    def writes(self, layer: int) -> tuple[Tensor, Tensor] | None:
        """Where `layer_project` writes layer ``layer``'s new keys, then values: a flat buffer
        [N, head_dim] and the rows to write (in the compiled decode step, in the same kernel as
        their rotation); None when this attention stores them itself or not at all."""
        ...

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Output [..., T, heads * D] for queries [..., T, heads, D] and keys, values
        [..., T, kv_heads, D] of layer ``layer``'s T tokens."""
        ...


class CausalAttention:
    """Attention of rows [B, T] of tokens over their own earlier tokens: ``mask`` and
    ``is_causal`` as `attend` takes them (`attention_mask` makes them)."""

    def __init__(self, mask: Tensor | None, is_causal: bool) -> None:
        self.mask = mask
        self.is_causal = is_causal

    def writes(self, layer: int) -> None:
        return None

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        b, t = q.shape[:2]
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.mask, self.is_causal)
        return out.transpose(1, 2).reshape(b, t, -1)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
    """Attention of [B, H, T, D] queries over [B, KV, S, D] keys/values (KV divides H), with a
    bool `mask` [T, S] or [B, 1, T, S] (True: attend; the same for every head) or `is_causal`."""
    if not q.is_cuda and q.shape[2] * k.shape[2] <= _MATH_MAX_SCORES:
        return _math_attention(q, k, v, mask, is_causal)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=q.shape[1] != k.shape[1]
    )


# On CPU, for short sequences, softmax(QK^T)V written out beats torch's CPU flash kernel: its
# backward dominates a training step (reverse-digits: 38 vs 43 ms a step) and each decode step
# pays its fixed cost (13 vs 15 ms to sample a batch). Above this many query x key positions
# the kernel's memory saving wins.
_MATH_MAX_SCORES = 128 * 128


def _math_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
    """`attend` written out: each key/value head serves its group of query heads through a
    reshape (no repeated copies of keys and values)."""
    b, h, t, d = q.shape
    kv, s = k.shape[1], k.shape[2]
    grouped = q.reshape(b, kv, (h // kv) * t, d)
    scores = (grouped @ k.transpose(-1, -2)).view(b, kv, h // kv, t, s) * d**-0.5
    if is_causal:
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    if mask is not None:
        scores = scores.masked_fill(~(mask.unsqueeze(2) if mask.dim() == 4 else mask), float("-inf"))
    weights = _Softmax.apply(scores.float()).to(v.dtype)
    return (weights.view(b, kv, (h // kv) * t, s) @ v).view(b, h, t, d)


class _Softmax(torch.autograd.Function):
    """Softmax over the last dimension. On CPU, torch's kernel is slow for the short rows of
    attention over a few keys (a fifth of the speed of this one at 11 keys)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        e = (x - x.amax(dim=-1, keepdim=True)).exp_()
        y = e.div_(e.sum(dim=-1, keepdim=True))
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        weighted = grad * y
        return weighted.sub_(y * weighted.sum(dim=-1, keepdim=True))


def attention_mask(
    key_mask: Tensor | None, t: int, start: int, device: torch.device
) -> tuple[Tensor | None, bool]:
    """`attend`'s ``(mask, is_causal)`` for T queries at absolute positions [start, start + T)
    over keys [0, start + T), ``key_mask`` [B, start + T] marking real keys (None: all are). A
    query whose own key is masked (padding) still attends to itself, so it never gives NaN."""
    if key_mask is None:
        if start == 0:
            return None, t > 1
        if t == 1:
            return None, False
    elif t == 1:
        # A single query is the newest position: causality masks nothing.
        return key_mask[:, None, None, :], False
    keys = torch.arange(start + t, device=device)
    queries = torch.arange(start, start + t, device=device).unsqueeze(-1)
    causal = keys <= queries
    if key_mask is None:
        return causal, False
    return (causal & key_mask[:, None, None, :]) | (keys == queries), False
