"""The CUDA sampler's in-graph draw as one pass over the logits (a Triton kernel).

A draw from softmax(logits / T) is the winner of an exponential race, argmax(logits / T -
log E) with E ~ Exp(1) per vocabulary entry. Here each entry's E comes from Philox counters
inside the kernel (`tl.rand`, seeded from a device scalar the caller refreshes from its
generator before each step), so no noise tensor (rows x vocab floats) is written or read, and
the same pass keeps the running max and sum of exp for the logsumexp: logits are read once.

Each program reduces one block of one row (four slices, one Philox call giving each column of a
slice its uniform) to partials (max, sum of exp, best score, its index
and logit); a few small ops combine a row's blocks. E = -log(1 - u) is computed from u's
series where u is small, since the race's winners have small E and 1 - u in float32 would
round them to a 2^-24 grid. With ``noisy`` 0 the race is the greedy argmax.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the sampler draws with torch ops there
    triton = None

BLOCK = 4096


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _block_stats(x, u, valid, noisy, cols):
        """(max, sum of exp(x - max), best race score, its column, its x) of one slice."""
        top = tl.max(x, axis=0)
        # A slice past the vocabulary's end holds only -inf: its sum is 0, not exp(-inf + inf).
        total = tl.sum(tl.where(valid, tl.exp(x - top), 0.0), axis=0)
        # u is k / 2^32 for a random 32-bit k, so it can be 0: moved to the middle of its step
        # ((k + 1/2) / 2^32, kept below 1 in float32), E is never 0 or infinite and the score
        # never infinite or NaN (greedy multiplies log E by 0).
        u = tl.minimum(u + 1.1641532182693481e-10, 0.99999994)
        # E = -log(1 - u), from its series where u is small (1 - u would round there).
        e = tl.where(u < 1e-3, u * (1.0 + u * (0.5 + u / 3.0)), -tl.log(1.0 - u))
        score = tl.where(valid, x - noisy * tl.log(e), float("-inf"))
        best = tl.max(score, axis=0)
        at = tl.arange(0, x.shape[0]) == tl.argmax(score, axis=0)
        picked = tl.max(tl.where(at, x, float("-inf")), axis=0)
        return top, total, best, tl.sum(tl.where(at, cols, 0), axis=0), picked

    @triton.jit
    def _merge(a, b):
        """Two slices' `_block_stats` as one."""
        top = tl.maximum(a[0], b[0])
        total = a[1] * tl.exp(a[0] - top) + b[1] * tl.exp(b[0] - top)
        take_b = b[2] > a[2]
        return (
            top,
            total,
            tl.where(take_b, b[2], a[2]),
            tl.where(take_b, b[3], a[3]),
            tl.where(take_b, b[4], a[4]),
        )

    @triton.jit
    def _partials(
        logits,
        seed_ptr,
        inv_t_ptr,
        noisy_ptr,
        out_max,
        out_sum,
        out_score,
        out_index,
        out_logit,
        vocab,
        blocks,
        QUARTER: tl.constexpr,
    ):
        # One Philox call gives four uniforms (`rand4x`): the block is four slices of QUARTER
        # columns, slice i taking the i-th uniform of each counter.
        row = tl.program_id(0)
        block = tl.program_id(1)
        lane = tl.arange(0, QUARTER)
        counter = (row * blocks + block) * QUARTER + lane
        u0, u1, u2, u3 = tl.rand4x(tl.load(seed_ptr), counter)
        inv_t = tl.load(inv_t_ptr)
        noisy = tl.load(noisy_ptr)
        base = logits + row.to(tl.int64) * vocab
        first = block * 4 * QUARTER + lane
        stats = _block_stats_at(base, first, vocab, inv_t, u0, noisy)
        stats = _merge(stats, _block_stats_at(base, first + QUARTER, vocab, inv_t, u1, noisy))
        stats = _merge(stats, _block_stats_at(base, first + 2 * QUARTER, vocab, inv_t, u2, noisy))
        stats = _merge(stats, _block_stats_at(base, first + 3 * QUARTER, vocab, inv_t, u3, noisy))
        out = row * blocks + block
        tl.store(out_max + out, stats[0])
        tl.store(out_sum + out, stats[1])
        tl.store(out_score + out, stats[2])
        tl.store(out_index + out, stats[3])
        tl.store(out_logit + out, stats[4])

    @triton.jit
    def _block_stats_at(base, cols, vocab, inv_t, u, noisy):
        valid = cols < vocab
        x = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
        return _block_stats(x, u, valid, noisy, cols)


def race_draw(logits: Tensor, inv_temperature: Tensor, seed: Tensor, noisy: Tensor) -> tuple[Tensor, Tensor]:
    """(token [rows] int64, its logprob under log_softmax(logits * inv_temperature) [rows]
    float32) from logits [rows, vocab] (contiguous, any float dtype). ``seed``: int64 device
    scalar; ``noisy``: float32 device scalar, 1 to sample, 0 for the argmax. Capturable in a
    CUDA graph (every input is read from device memory)."""
    rows, vocab = logits.shape
    if logits.stride() != (vocab, 1):
        raise ValueError(f"race_draw needs contiguous logits, got strides {logits.stride()}")
    blocks = triton.cdiv(vocab, BLOCK)
    shape = (rows, blocks)
    top, total, score, logit = (
        torch.empty(shape, dtype=torch.float32, device=logits.device) for _ in range(4)
    )
    index = torch.empty(shape, dtype=torch.int32, device=logits.device)
    _partials[(rows, blocks)](
        logits,
        seed,
        inv_temperature,
        noisy,
        top,
        total,
        score,
        index,
        logit,
        vocab,
        blocks,
        QUARTER=BLOCK // 4,
        num_warps=8,
    )
    row_top = top.amax(dim=1, keepdim=True)
    lse = row_top.squeeze(1) + (total * (top - row_top).exp()).sum(dim=1).log()
    winner = score.argmax(dim=1, keepdim=True)
    token = index.gather(1, winner).squeeze(1).long()
    return token, logit.gather(1, winner).squeeze(1) - lse
