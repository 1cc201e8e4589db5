"""Response logprobs for GRPO groups, computing each group's shared prompt once.

Every sample of a group continues the same prompt, so a full-sequence forward would push the
prompt through the model once per sample. `response_logprobs` runs each distinct prompt once and
only the response tokens of each sample, in one pass over the model: the layers' position-wise
work (norms, projections, MLP) runs on all prompt and response tokens packed together, and only
attention splits them (the pass's `LayerAttention`, `_PromptShared`), each response row
attending over its prompt's keys/values (left-padded, the padding masked) and its own earlier
response tokens. Gradients flow through both. For the CPU quickstart (7 prompt + 5 response
tokens, groups of 8) this pushes 1.2k instead of 2.8k tokens through the layers, with one call
of each layer op instead of two.

The positions are the sampler's own (each prompt's tokens at 0..n-1), so in fp32 the logprobs
equal the engine's to rounding (the trainer's `train/gen_kl_error` stays near 0 on-policy).

Options: ``compiled`` runs each layer's position-wise parts (norms, projections, rotation,
residuals, SwiGLU) as torch.compile'd kernels, one compiled version serving every layer (their
parameters are its inputs) and any number of tokens (dynamo's automatic dynamic shapes);
attention stays outside them (`Decoder.run_layers`, as every path runs the layers). On CUDA in
half precision the responses' attention is one variable-length flash call (each row's keys: its
prompt's real tokens, then its own; causal aligned bottom-right), elsewhere SDPA with an
explicit mask. ``checkpointed`` keeps only each layer's input for the backward pass and
recomputes the layer there (activation checkpointing: about a third more compute for a few
percent of the activation memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from backends.torch.attention import attend, attention_mask
from backends.torch.logprobs import picked_logprobs
from backends.torch.model import PLAIN_PARTS, Decoder, compiled_layer_parts


def response_logprobs(
    model: Decoder,
    prompts: Sequence[Sequence[int]],
    owner: Sequence[int],
    responses: Sequence[Sequence[int]],
    temperature: float,
    *,
    compiled: bool = False,
    checkpointed: bool = False,
) -> tuple[Tensor, Tensor]:
    """(logprobs, mask), both float32 [N, R]: log p(responses[i][j] | prompt, responses[i][:j]).

    `prompts`: the distinct prompts; `owner[i]`: the index in `prompts` of sample i's prompt;
    `responses`: N non-empty token lists (right-padded internally; `mask` marks real tokens).
    """
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    longest = max(len(r) for r in responses)
    rows = torch.tensor(owner, device=device)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    prefix_ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], device=device)
    pad = (width - lengths).unsqueeze(1)
    real = torch.arange(width, device=device) >= pad
    padded = bool((lengths < width).any())
    targets = torch.tensor([list(r) + [0] * (longest - len(r)) for r in responses], device=device)
    # Response token j (j < longest - 1) is the input that predicts token j + 1.
    suffix_positions = lengths[rows].unsqueeze(1) + torch.arange(longest - 1, device=device)
    prefix, suffix = _hidden(
        model,
        prefix_ids,
        (torch.arange(width, device=device) - pad).clamp(min=0),
        real if padded else None,
        rows,
        targets[:, :-1],
        suffix_positions,
        compiled=compiled,
        checkpointed=checkpointed,
    )
    hidden = torch.cat([prefix[:, -1][rows].unsqueeze(1), suffix], dim=1)
    mask = (
        torch.arange(longest, device=device)
        < torch.tensor([len(r) for r in responses], device=device)[:, None]
    )
    logprobs = picked_logprobs(hidden, model.lm_head.weight, targets, temperature)
    return logprobs.masked_fill(~mask, 0.0), mask.float()


def _hidden(
    model: Decoder,
    prefix_ids: Tensor,
    prefix_positions: Tensor,
    prefix_real: Tensor | None,
    rows: Tensor,
    suffix_ids: Tensor,
    suffix_positions: Tensor,
    *,
    compiled: bool,
    checkpointed: bool,
) -> tuple[Tensor, Tensor]:
    """Final-norm hidden states of the prompts [P, W, H] and of the responses [N, S, H].

    Prompt p is `prefix_ids[p]` (left-padded, `prefix_real` marking real tokens, None: all
    are); response row i continues prompt `rows[i]` with `suffix_ids[i]`.
    """
    (p, w), (n, s) = prefix_ids.shape, suffix_ids.shape
    split = p * w
    ids = torch.cat([prefix_ids.reshape(-1), suffix_ids.reshape(-1)])
    positions = torch.cat([prefix_positions.reshape(-1), suffix_positions.reshape(-1)])
    x = model.embed(ids, positions)  # [T, H], T = P*W + N*S
    cos, sin = model.rotary(positions)
    attention = _PromptShared(p, w, n, s, rows, prefix_real, flash=_flash_usable(x))
    parts = compiled_layer_parts() if compiled else PLAIN_PARTS
    x = model.model.norm(model.run_layers(x, cos, sin, attention, parts, checkpointed=checkpointed))
    hidden = x.shape[-1]  # explicit: with one-token responses (s = 0) -1 would be ambiguous
    return x[:split].view(p, w, hidden), x[split:].view(n, s, hidden)


class _PromptShared:
    """The pass's `LayerAttention` over its packed tokens [T]: P prompts of W (left-padded,
    ``prefix_real`` marking real tokens, None: all are), then N responses of S tokens, response
    i continuing prompt ``rows[i]`` and attending over its real tokens and its own earlier ones."""

    def __init__(
        self, p: int, w: int, n: int, s: int, rows: Tensor, prefix_real: Tensor | None, *, flash: bool
    ) -> None:
        self.p, self.w, self.n, self.s, self.rows = p, w, n, s, rows
        self.split = p * w
        device = rows.device
        self.prefix_mask, self.prefix_causal = attention_mask(prefix_real, w, 0, device)
        self.flash = _flash_layout(rows, prefix_real, w, s, self.split) if n * s and flash else None
        self.suffix_mask = None
        if self.flash is None:
            suffix_keys = None
            if prefix_real is not None:
                suffix_keys = torch.cat([prefix_real[rows], prefix_real.new_ones(n, s)], dim=1)
            self.suffix_mask, _ = attention_mask(suffix_keys, s, w, device)

    def writes(self, layer: int) -> None:
        return None

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        p, w, n, s, split = self.p, self.w, self.n, self.s, self.split

        def heads(y: Tensor, batch: int, length: int) -> Tensor:  # [B*L, n, D] -> [B, n, L, D]
            return y.view(batch, length, *y.shape[1:]).transpose(1, 2)

        qp, kp, vp = (heads(y[:split], p, w) for y in (q, k, v))
        out = attend(qp, kp, vp, self.prefix_mask, self.prefix_causal).transpose(1, 2).reshape(split, -1)
        if self.flash is not None:
            out_s = _flash_attend(q[split:], k, v, self.flash)
        elif n * s:
            qs, ks, vs = (heads(y[split:], n, s) for y in (q, k, v))
            keys = torch.cat([kp[self.rows], ks], dim=2)
            values = torch.cat([vp[self.rows], vs], dim=2)
            out_s = attend(qs, keys, values, self.suffix_mask, False).transpose(1, 2)
        else:
            return out
        return torch.cat([out, out_s.reshape(n * s, -1)])


class _FlashLayout(NamedTuple):
    """The responses' attention as flash's variable-length problem: row i's queries are its S
    response positions, its keys its prompt's real tokens (no padding) then those S."""

    keys: Tensor  # [K]: where each key is in a layer's packed [T, kv_heads, D] keys and values
    cu_q: Tensor
    cu_k: Tensor
    queries: int
    max_keys: int


def _flash_usable(x: Tensor) -> bool:
    """Whether the responses' attention runs as one flash call (`_flash_attend`): CUDA, half
    precision. Elsewhere it is SDPA with an explicit mask (prompt keys then causal), which
    keeps SDPA off its flash kernel."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def _flash_layout(rows: Tensor, prefix_real: Tensor | None, w: int, s: int, split: int) -> _FlashLayout:
    n, dev = rows.numel(), rows.device
    prompt = (prefix_real.sum(1) if prefix_real is not None else torch.full_like(rows, w))[rows]
    per_row = prompt + s
    cu_k = F.pad(per_row.cumsum(0), (1, 0)).to(torch.int32)
    row = torch.arange(n, device=dev).repeat_interleave(per_row)
    offset = torch.arange(row.numel(), device=dev) - cu_k[:-1][row]
    in_prompt = offset < prompt[row]
    keys = torch.where(
        in_prompt,
        rows[row] * w + (w - prompt[row]) + offset,  # prompts are left-padded to w
        split + row * s + offset - prompt[row],
    )
    cu_q = torch.arange(0, (n + 1) * s, s, dtype=torch.int32, device=dev)
    return _FlashLayout(keys, cu_q, cu_k, s, int(per_row.max()))


def _flash_attend(q: Tensor, k: Tensor, v: Tensor, layout: _FlashLayout) -> Tensor:
    """Responses' attention output [N * S, heads, D] from their queries [N * S, heads, D] and the
    layer's packed keys and values [T, kv_heads, D]. Flash aligns causality bottom-right when a
    row has more keys than queries: each response position sees its prompt and itself back."""
    return torch.ops.aten._flash_attention_forward(
        q,
        k.index_select(0, layout.keys),
        v.index_select(0, layout.keys),
        layout.cu_q,
        layout.cu_k,
        layout.queries,
        layout.max_keys,
        0.0,
        True,
        False,
    )[0]
