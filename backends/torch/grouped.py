"""Response logprobs for GRPO groups, computing each group's shared prompt once.

Every sample of a group continues the same prompt, so a full-sequence forward would push the
prompt through the model once per sample. `response_logprobs` runs each distinct prompt once and
only the response tokens of each sample, in one pass over the model: the layers' position-wise
work (norms, projections, MLP) runs on all prompt and response tokens packed together, and only
attention splits them (the pass's `LayerAttention`, `_PromptShared`), each response row
attending over its prompt's keys/values (left-padded, the padding masked) and its own earlier
response tokens. Responses are packed end to end, each at its own length (`Packing`): no
response is padded to a longer one, so a long-tailed micro-batch (one response of 2048 tokens
beside many of 200) computes its real tokens only, in the layers and in the output projection.
Gradients flow through both. For the CPU quickstart (7 prompt + 5 response
tokens, groups of 8) this pushes 1.2k instead of 2.8k tokens through the layers, with one call
of each layer op instead of two.

The positions are the sampler's own (each prompt's tokens at 0..n-1), so in fp32 the logprobs
equal the engine's to rounding (the trainer's `train/gen_kl_error` stays near 0 on-policy).

Options: ``compiled`` runs each layer's position-wise parts (norms, projections, rotation,
residuals, SwiGLU) as torch.compile'd kernels, one compiled version serving every layer (their
parameters are its inputs) and any number of tokens (dynamo's automatic dynamic shapes);
attention stays outside them (`Decoder.run_layers`, as every path runs the layers). On CUDA in
half precision the responses' attention is one variable-length flash call over the packed
inputs (each row's keys: its prompt's real tokens, then its own; causal aligned bottom-right);
elsewhere the inputs are spread to a padded [N, S] layout for SDPA with an explicit mask, and
gathered back, so the padding costs attention only. ``checkpointed`` keeps only each layer's
input for the backward pass and recomputes the layer there (activation checkpointing: about a
third more compute for a few percent of the activation memory).
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
    `responses`: N non-empty token lists. The pass computes each response at its own length
    (packed, no padding: `Packing`); only the returned tensors are right-padded to the longest,
    `mask` marking real tokens.
    """
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    rows = torch.tensor(owner, device=device)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    prefix_ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], device=device)
    pad = (width - lengths).unsqueeze(1)
    real = torch.arange(width, device=device) >= pad
    padded = bool((lengths < width).any())
    packing = Packing.of([len(r) for r in responses], device)
    # Response token j (j < its length - 1) is the input that predicts token j + 1.
    inputs = torch.tensor([t for r in responses for t in r[:-1]], dtype=torch.long, device=device)
    suffix_positions = lengths[rows][packing.input_row] + packing.input_offset
    prefix, suffix = _hidden(
        model,
        prefix_ids,
        (torch.arange(width, device=device) - pad).clamp(min=0),
        real if padded else None,
        rows,
        inputs,
        suffix_positions,
        packing,
        compiled=compiled,
        checkpointed=checkpointed,
    )
    # The hidden state before each target: its prompt's last for token 0, else its own input's.
    hidden = torch.cat([prefix[:, -1][rows], suffix]).index_select(0, packing.before_target)
    targets = torch.tensor([t for r in responses for t in r], dtype=torch.long, device=device)
    flat = picked_logprobs(hidden, model.lm_head.weight, targets, temperature)
    where = (packing.target_row, packing.target_offset)
    logprobs = flat.new_zeros(len(responses), packing.longest).index_put(where, flat)
    mask = torch.zeros(len(responses), packing.longest, device=device).index_put(where, torch.ones_like(flat))
    return logprobs, mask


class Packing(NamedTuple):
    """N responses packed end to end, each at its own length: its T targets (all its tokens)
    and its T - 1 inputs (all but its last), both flat and in response order.

    `input_row`/`input_offset`: each packed input's response and index in it;
    `target_row`/`target_offset`: likewise for the targets; `before_target`: for each target,
    its hidden state's row in [the N prompts' last states, then the packed inputs' states];
    `input_lengths` [N] (T - 1 each); `longest`: the longest T."""

    input_row: Tensor
    input_offset: Tensor
    target_row: Tensor
    target_offset: Tensor
    before_target: Tensor
    input_lengths: Tensor
    longest: int

    @classmethod
    def of(cls, lengths: Sequence[int], device: torch.device) -> Packing:
        n = len(lengths)
        total = torch.tensor(lengths, device=device)
        target_row = torch.arange(n, device=device).repeat_interleave(total)
        target_offset = torch.arange(target_row.numel(), device=device) - _starts(total)[target_row]
        input_lengths = total - 1
        input_row = torch.arange(n, device=device).repeat_interleave(input_lengths)
        input_start = _starts(input_lengths)
        input_offset = torch.arange(input_row.numel(), device=device) - input_start[input_row]
        before_target = torch.where(
            target_offset == 0, target_row, n + input_start[target_row] + target_offset - 1
        )
        return cls(
            input_row, input_offset, target_row, target_offset, before_target, input_lengths, max(lengths)
        )


def _starts(lengths: Tensor) -> Tensor:
    """Where each of consecutive runs of `lengths` starts."""
    return F.pad(lengths.cumsum(0), (1, 0))[:-1]


def _hidden(
    model: Decoder,
    prefix_ids: Tensor,
    prefix_positions: Tensor,
    prefix_real: Tensor | None,
    rows: Tensor,
    suffix_ids: Tensor,
    suffix_positions: Tensor,
    packing: Packing,
    *,
    compiled: bool,
    checkpointed: bool,
) -> tuple[Tensor, Tensor]:
    """Final-norm hidden states of the prompts [P, W, H] and of the responses' packed inputs
    [I, H].

    Prompt p is `prefix_ids[p]` (left-padded, `prefix_real` marking real tokens, None: all
    are); response i continues prompt `rows[i]` with its inputs, packed in `suffix_ids` [I].
    """
    p, w = prefix_ids.shape
    split = p * w
    ids = torch.cat([prefix_ids.reshape(-1), suffix_ids])
    positions = torch.cat([prefix_positions.reshape(-1), suffix_positions])
    x = model.embed(ids, positions)  # [T, H], T = P*W + I
    cos, sin = model.rotary(positions)
    # The layers' own dtype, not the residual stream's: `model.residual: float32` keeps the sums
    # in float32, while queries, keys and values come out of the projections in half precision.
    flash = _flash_usable(x.device, model.lm_head.weight.dtype)
    attention = _PromptShared(p, w, rows, prefix_real, packing, flash=flash)
    parts = compiled_layer_parts() if compiled else PLAIN_PARTS
    x = model.model.norm(model.run_layers(x, cos, sin, attention, parts, checkpointed=checkpointed))
    hidden = x.shape[-1]
    return x[:split].view(p, w, hidden), x[split:]


class _PromptShared:
    """The pass's `LayerAttention` over its packed tokens [T]: P prompts of W (left-padded,
    ``prefix_real`` marking real tokens, None: all are), then the N responses' inputs packed
    (`Packing`), response i continuing prompt ``rows[i]`` and attending over its real tokens
    and its own earlier ones. Flash (CUDA, half precision) takes the packed inputs as they are;
    elsewhere they are laid out padded [N, S] for a masked SDPA and the padding dropped after."""

    def __init__(
        self, p: int, w: int, rows: Tensor, prefix_real: Tensor | None, packing: Packing, *, flash: bool
    ) -> None:
        self.p, self.w, self.rows, self.packing = p, w, rows, packing
        self.split = p * w
        self.n = rows.numel()
        self.inputs = packing.input_row.numel()
        self.s = packing.longest - 1
        device = rows.device
        self.prefix_mask, self.prefix_causal = attention_mask(prefix_real, w, 0, device)
        self.flash = None
        self.suffix_mask = None
        if not self.inputs:
            return
        if flash:
            self.flash = _flash_layout(rows, prefix_real, w, packing, self.split)
            return
        # Where each packed input sits in the padded [N * S] layout.
        self.padded_index = packing.input_row * self.s + packing.input_offset
        # A row's padding comes after its real inputs, out of their causal reach: only the
        # prompts' padding needs a mask.
        suffix_keys = None
        if prefix_real is not None:
            suffix_keys = torch.cat([prefix_real[rows], prefix_real.new_ones(self.n, self.s)], dim=1)
        self.suffix_mask, _ = attention_mask(suffix_keys, self.s, w, device)

    def writes(self, layer: int) -> None:
        return None

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        p, w, n, s, split = self.p, self.w, self.n, self.s, self.split

        def heads(y: Tensor, batch: int, length: int) -> Tensor:  # [B*L, n, D] -> [B, n, L, D]
            return y.view(batch, length, *y.shape[1:]).transpose(1, 2)

        qp, kp, vp = (heads(y[:split], p, w) for y in (q, k, v))
        out = attend(qp, kp, vp, self.prefix_mask, self.prefix_causal).transpose(1, 2).reshape(split, -1)
        if not self.inputs:
            return out
        if self.flash is not None:
            out_s = _flash_attend(q[split:], k, v, self.flash)
        else:

            def unpack(y: Tensor) -> Tensor:  # packed [I, n, D] -> [N, n, S, D]
                spread = y.new_zeros(n * s, *y.shape[1:]).index_copy(0, self.padded_index, y)
                return heads(spread, n, s)

            qs, ks, vs = (unpack(y[split:]) for y in (q, k, v))
            keys = torch.cat([kp[self.rows], ks], dim=2)
            values = torch.cat([vp[self.rows], vs], dim=2)
            spread = attend(qs, keys, values, self.suffix_mask, False).transpose(1, 2)
            out_s = spread.reshape(n * s, -1).index_select(0, self.padded_index)
        return torch.cat([out, out_s.reshape(self.inputs, -1)])


class _FlashLayout(NamedTuple):
    """The responses' attention as flash's variable-length problem: row i's queries are its
    packed inputs, its keys its prompt's real tokens (no padding) then those inputs."""

    keys: Tensor  # [K]: where each key is in a layer's packed [T, kv_heads, D] keys and values
    cu_q: Tensor
    cu_k: Tensor
    queries: int
    max_keys: int


def _flash_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the responses' attention runs as one flash call (`_flash_attend`): on CUDA, with
    layers (`dtype`) in half precision. Elsewhere it is SDPA with an explicit mask (prompt keys
    then causal) over the responses padded to the longest, which keeps SDPA off its flash
    kernel and costs a long-tailed micro-batch its padding's attention."""
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def _flash_layout(
    rows: Tensor, prefix_real: Tensor | None, w: int, packing: Packing, split: int
) -> _FlashLayout:
    """Rows with no inputs (one-token responses) have no queries and are left out."""
    dev = rows.device
    has = packing.input_lengths > 0
    own = packing.input_lengths[has]
    n = int(own.numel())
    starts = _starts(packing.input_lengths)[has]
    owners = rows[has]
    prompt = (prefix_real.sum(1) if prefix_real is not None else torch.full_like(rows, w))[owners]
    per_row = prompt + own
    cu_k = F.pad(per_row.cumsum(0), (1, 0)).to(torch.int32)
    row = torch.arange(n, device=dev).repeat_interleave(per_row)
    offset = torch.arange(row.numel(), device=dev) - cu_k[:-1][row]
    in_prompt = offset < prompt[row]
    keys = torch.where(
        in_prompt,
        owners[row] * w + (w - prompt[row]) + offset,  # prompts are left-padded to w
        split + starts[row] + offset - prompt[row],
    )
    cu_q = F.pad(own.cumsum(0), (1, 0)).to(torch.int32)
    return _FlashLayout(keys, cu_q, cu_k, int(own.max()), int(per_row.max()))


def _flash_attend(q: Tensor, k: Tensor, v: Tensor, layout: _FlashLayout) -> Tensor:
    """Responses' attention output [I, heads, D] from their packed queries [I, heads, D] and the
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
