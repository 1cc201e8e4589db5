"""The CUDA sampler's in-graph draw as one pass over the logits (two Triton kernels).

A draw from softmax(logits / T) is the winner of an exponential race, argmax(logits / T -
log E) with E ~ Exp(1) per vocabulary entry. Here each entry's E comes from Philox counters
inside the kernel (`tl.rand4x`, seeded from a device scalar the caller refreshes from its
generator before each step), so no noise tensor (rows x vocab floats) is written or read, and
the same pass keeps the running max and sum of exp for the logsumexp: logits are read once.

`_partials`: each program walks one chunk of one row in tiles of four slices (one Philox call
gives each column of a slice its uniform), each lane keeping its own running (max, sum of exp,
best score, its column, its logit) with elementwise updates only; the lanes are reduced once at
the chunk's end. `_combine`: one program a row merges its chunks and writes the token and its
logprob. Ties go to the lowest column, as torch's argmax. E = -log(1 - u) is computed from u's
series where u is small, since the race's winners have small E and 1 - u in float32 would round
them to a 2^-24 grid. The noise's logs are the fast (approximate) ones, about 2^-22 off: the
kernel is bound by arithmetic, not by reading the logits (105 us for 256 x 151936 bf16 on an
H200, 38 us to read them). With ``noisy`` 0 the race is the greedy argmax.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs: the sampler draws with torch ops there
    triton = None

# Columns a lane set covers per Philox call (four slices of SLICE), and per program.
SLICE = 512
CHUNK = 16384


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _score(x, u, noisy):
        """Race score x - noisy * log E of logits x (-inf past the vocabulary) and uniforms u."""
        # u is k / 2^32 for a random 32-bit k, so it can be 0: moved to the middle of its step
        # ((k + 1/2) / 2^32, kept below 1 in float32), E is never 0 or infinite and the score
        # never infinite or NaN (greedy multiplies log E by 0).
        u = tl.minimum(u + 1.1641532182693481e-10, 0.99999994)
        # E = -log(1 - u), from its series where u is small: 1 - u would round there, and the
        # fast log's absolute error (about 2^-22) would be large against E.
        series = u * (1.0 + u * (0.5 + u * (0.33333334 + u * 0.25)))
        e = tl.where(u < 0.01, series, -libdevice.fast_logf(1.0 - u))
        return x - noisy * libdevice.fast_logf(e)

    @triton.jit
    def _take(best, at, picked, score, cols, x):
        """Per lane: the better of the kept (best, at, picked) and a later slice's; ties keep
        the earlier column."""
        better = score > best
        return tl.where(better, score, best), tl.where(better, cols, at), tl.where(better, x, picked)

    @triton.jit
    def _load(base, cols, vocab, inv_t):
        return tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) * inv_t

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
        row_stride,
        chunks,
        SLICE: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        lane = tl.arange(0, SLICE)
        seed = tl.load(seed_ptr)
        inv_t = tl.load(inv_t_ptr)
        noisy = tl.load(noisy_ptr)
        base = logits + row.to(tl.int64) * row_stride
        counters = (row * chunks + chunk) * (CHUNK // 4) + lane
        top = tl.full((SLICE,), float("-inf"), tl.float32)
        total = tl.zeros((SLICE,), tl.float32)
        best = tl.full((SLICE,), float("-inf"), tl.float32)
        at = tl.zeros((SLICE,), tl.int32)
        picked = tl.zeros((SLICE,), tl.float32)
        for tile in range(CHUNK // (4 * SLICE)):
            first = chunk * CHUNK + tile * 4 * SLICE + lane
            u0, u1, u2, u3 = tl.rand4x(seed, counters + tile * SLICE)
            x0 = _load(base, first, vocab, inv_t)
            x1 = _load(base, first + SLICE, vocab, inv_t)
            x2 = _load(base, first + 2 * SLICE, vocab, inv_t)
            x3 = _load(base, first + 3 * SLICE, vocab, inv_t)
            new_top = tl.maximum(tl.maximum(top, tl.maximum(x0, x1)), tl.maximum(x2, x3))
            # A lane that has seen only -inf (past the vocabulary) keeps a sum of 0.
            ref = tl.where(new_top == float("-inf"), 0.0, new_top)
            total = total * tl.exp(top - ref) + (
                tl.exp(x0 - ref) + tl.exp(x1 - ref) + tl.exp(x2 - ref) + tl.exp(x3 - ref)
            )
            top = new_top
            best, at, picked = _take(best, at, picked, _score(x0, u0, noisy), first, x0)
            best, at, picked = _take(best, at, picked, _score(x1, u1, noisy), first + SLICE, x1)
            best, at, picked = _take(best, at, picked, _score(x2, u2, noisy), first + 2 * SLICE, x2)
            best, at, picked = _take(best, at, picked, _score(x3, u3, noisy), first + 3 * SLICE, x3)
        chunk_top = tl.max(top, axis=0)
        out = row * chunks + chunk
        tl.store(out_max + out, chunk_top)
        tl.store(out_sum + out, tl.sum(tl.where(total > 0, total * tl.exp(top - chunk_top), 0.0), axis=0))
        chunk_best = tl.max(best, axis=0)
        leads = best == chunk_best
        winner = tl.min(tl.where(leads, at, 2147483647), axis=0)
        tl.store(out_score + out, chunk_best)
        tl.store(out_index + out, winner)
        # (Lanes that saw only columns past the vocabulary keep column 0 and logit 0: not leads.)
        tl.store(out_logit + out, tl.max(tl.where(leads & (at == winner), picked, float("-inf")), axis=0))

    @triton.jit
    def _combine(
        top_ptr, sum_ptr, score_ptr, index_ptr, logit_ptr, token_out, logprob_out, chunks, N: tl.constexpr
    ):
        row = tl.program_id(0)
        i = tl.arange(0, N)
        valid = i < chunks
        at = row * chunks + i
        top = tl.load(top_ptr + at, mask=valid, other=float("-inf"))
        total = tl.load(sum_ptr + at, mask=valid, other=0.0)
        score = tl.load(score_ptr + at, mask=valid, other=float("-inf"))
        row_top = tl.max(top, axis=0)
        lse = row_top + tl.log(tl.sum(tl.where(valid, total * tl.exp(top - row_top), 0.0), axis=0))
        # The first chunk with the best score (chunks are in column order).
        first = tl.min(tl.where(score == tl.max(score, axis=0), i, N), axis=0)
        tl.store(token_out + row, tl.load(index_ptr + row * chunks + first).to(tl.int64))
        tl.store(logprob_out + row, tl.load(logit_ptr + row * chunks + first) - lse)


def race_draw(
    logits: Tensor,
    inv_temperature: Tensor,
    seed: Tensor,
    noisy: Tensor,
    out: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """(token [rows] int64, its logprob under log_softmax(logits * inv_temperature) [rows]
    float32) from logits [rows, vocab] (each row contiguous; rows may be padded apart, as
    cuBLAS leaves a bf16 head's output for some widths; any float dtype), written into ``out``
    when given. ``seed``: int64 device scalar; ``noisy``: float32 device scalar, 1 to sample,
    0 for the argmax. Capturable in a CUDA graph (every input is read from device memory)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError(f"race_draw needs each row of logits contiguous, got strides {logits.stride()}")
    chunks = triton.cdiv(vocab, CHUNK)
    dev = logits.device
    top, total, score, logit = (torch.empty(rows, chunks, dtype=torch.float32, device=dev) for _ in range(4))
    index = torch.empty(rows, chunks, dtype=torch.int32, device=dev)
    _partials[(rows, chunks)](
        logits, seed, inv_temperature, noisy, top, total, score, index, logit,
        vocab, logits.stride(0), chunks, SLICE=SLICE, CHUNK=CHUNK, num_warps=4,
    )  # fmt: skip
    token, logprob = out if out is not None else (
        torch.empty(rows, dtype=torch.long, device=dev),
        torch.empty(rows, dtype=torch.float32, device=dev),
    )  # fmt: skip
    _combine[(rows,)](
        top, total, score, index, logit, token, logprob, chunks, N=triton.next_power_of_2(chunks)
    )
    return token, logprob
