"""Decode attention straight over a paged KV cache (two Triton kernels): megatron's, for the
flash adapter's `flash_attn_with_kvcache` on CUDA, and the torch engine's, for its decode steps
(`decode_step.py`: each cache row one block of its keys).

`attend(q, k_cache, v_cache, block_table, cache_seqlens, scale, causal)` takes flash-attn's
decode arguments as megatron's dynamic engine passes them: queries [B, S, H, D] (S new tokens a
request, their keys already written to the cache), caches [blocks, block_tokens, kv_heads, D],
a block table whose row b lists request b's blocks in order (rows past B and columns past a
row's length are never read, so -1 there is harmless), and cache_seqlens [B], each request's
key count. With `causal`, query s of S sees the first seqlen - (S - 1 - s) keys (flash-attn's
bottom-right alignment); without it every query sees all seqlen keys. It returns the output
[B, S, H, D] in q's dtype and the natural-log logsumexp of each query's scores [B, H, S]
(float32); a query with no keys gets output 0 and logsumexp -inf.

Each program of `_partials` takes one query row and one KV head with the GROUP query heads
that share it (GQA: the keys are read once for the group), and walks that row's own blocks in
tiles of TILE keys with an online softmax: only the keys a row holds are read, whatever the
table's width. Each row's keys are split in SPLITS equal shares of whole tiles, one program
each (flash-decoding), whose partial sums `_combine` merges: a row's share follows from its own
length inside the kernel, while TILE and SPLITS follow from the shapes and the device alone
(`tile`, `splits`), never from the lengths: a launch syncs nothing with the device, allocates only what
the shapes fix, and so can be captured in a CUDA graph and replayed for other lengths. Where a
tile's keys lie in one block (blocks of whole tiles, as megatron's 256-token ones; a table of one
block a row, as the torch engine's cache rows), its block number is read once a tile rather than
once a key.

Compiled, the tiles are walked by a `for` loop, which Triton pipelines (the next tiles' loads
overlap the current tile's math). Triton's interpreter, which runs the kernels on CPU tensors
for the tests, cannot take a `for` loop whose bounds are tensors (under numpy 2): there the same
tiles are walked by a `while` loop (`STEPPED`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the flash adapter gathers the blocks there
    triton = None

# Keys a program reads at once: WIDE_TILE from WIDE_PAIRS (query row, KV head) pairs up, whose
# keys then split until four programs an SM instead of eight; an H200 sweep over widths and
# length mixes (bench/results-h200.json, session_2026-12-04b).
TILE, WIDE_TILE, WIDE_PAIRS = 64, 128, 192
WARPS, STAGES = 4, 2  # `_partials`' launch: warps a program, pipeline stages (H200 sweep)
PROGRAMS_AN_SM = {TILE: 8, WIDE_TILE: 4}  # what `splits` fills the SMs to, by tile
MAX_SPLITS = 16
# At most one split for each MIN_SPLIT_KEYS keys a row can hold (the table's width): each split
# adds a partial output to merge, and a short row's splits past its keys have none to read.
MIN_SPLIT_KEYS = 256


def supports(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, cache_seqlens: Tensor) -> bool:
    """Whether `attend` runs these inputs: Triton present, CUDA tensors (or Triton's
    interpreter on CPU ones), a power-of-two head dim from 16 to 256, query heads a multiple of
    the KV heads, each head's elements, each table row and the lengths contiguous."""
    interpreted = triton is not None and triton.knobs.runtime.interpret
    return (
        triton is not None
        and (q.is_cuda or interpreted)
        and takes_head_dim(q.shape[-1])
        and q.shape[-2] % k_cache.shape[2] == 0
        and q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
        and block_table.stride(-1) == cache_seqlens.stride(0) == 1
    )


def takes_head_dim(d: int) -> bool:
    """Whether the kernels take heads of `d` elements: a power of two from 16 to 256 (Triton's
    ranges are powers of two, its dot products at least 16 deep)."""
    return 16 <= d <= 256 and d & (d - 1) == 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tile(programs: int) -> int:
    """Keys a program reads at once over `programs` (query row, KV head) pairs."""
    return WIDE_TILE if programs >= WIDE_PAIRS else TILE


def splits(programs: int, width: int, device: torch.device) -> int:
    """Programs each (query row, KV head) pair's keys are split over: a power of two, enough for
    `PROGRAMS_AN_SM` of the pairs' tile over the `programs` pairs (rounded down), each split at
    least MIN_SPLIT_KEYS of the `width` keys a row can hold (the block table's width), at most
    MAX_SPLITS. Rows of unequal lengths leave a program a row idle while the longest finish;
    equal shares of each row over several programs keep the SMs busy (an H200 sweep of the
    split count against widths and length mixes: bench/results-h200.json, session_2026-12-04)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = min(_cdiv(PROGRAMS_AN_SM[tile(programs)] * sms, programs), width // MIN_SPLIT_KEYS, MAX_SPLITS)
    return 1 if want <= 1 else 1 << (want.bit_length() - 1)


def attend(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cache_seqlens: Tensor,
    scale: float,
    causal: bool,
    num_splits: int | None = None,
    keys_a_tile: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of q over each request's cached keys (module docstring); `num_splits`, a power
    of two, overrides `splits`, and `keys_a_tile` `tile` (tests)."""
    b, s, h, d = q.shape
    block_tokens, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = h // kv_heads
    rows = q.reshape(b * s, h, d)
    width = block_table.shape[1] * block_tokens
    n = num_splits or splits(b * s * kv_heads, width, q.device)
    tile_keys = keys_a_tile or tile(b * s * kv_heads)
    out = torch.empty(b * s, h, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b * s, h, dtype=torch.float32, device=q.device)
    parts = (b * s, h, n)
    part_out = torch.empty(*parts, d, dtype=torch.float32, device=q.device) if n > 1 else out
    part_max = torch.empty(parts, dtype=torch.float32, device=q.device) if n > 1 else lse
    part_sum = torch.empty(parts, dtype=torch.float32, device=q.device) if n > 1 else lse
    _partials[(b * s, kv_heads, n)](
        rows,
        k_cache,
        v_cache,
        block_table,
        cache_seqlens,
        out,
        lse,
        part_out,
        part_max,
        part_sum,
        rows.stride(0),
        rows.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_table.stride(0),
        scale * math.log2(math.e),
        s,
        block_tokens,
        CAUSAL=causal,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        D=d,
        TILE=tile_keys,
        SPLITS=n,
        STEPPED=triton.knobs.runtime.interpret,
        WHOLE=block_tokens % tile_keys == 0 or block_table.shape[1] == 1,
        num_warps=WARPS,
        num_stages=STAGES,
    )
    if n > 1:
        _combine[(b * s, h)](part_out, part_max, part_sum, out, lse, D=d, SPLITS=n)
    return out.view(b, s, h, d), lse.view(b, s, h).transpose(1, 2)


if triton is not None:

    @triton.jit
    def _logsumexp(top, total):
        """The natural-log logsumexp of scores (log2 units) whose max is `top` and whose
        exp2(score - top) sum to `total`; -inf for no scores."""
        held = total > 0
        return tl.where(held, (top + tl.log2(tl.where(held, total, 1.0))) * 0.6931471805599453, float("-inf"))

    @triton.jit
    def _tile(
        query,
        k_head,
        v_head,
        row_table,
        first,
        end,
        block_tokens,
        stride_kb,
        stride_kt,
        stride_vb,
        stride_vt,
        scale_log2,
        top,
        total,
        acc,
        D: tl.constexpr,
        TILE: tl.constexpr,
        WHOLE: tl.constexpr,
    ):
        """The online softmax's running (max, total, sum) after the keys first..first + TILE
        (those below `end`) of one row, read through its row of the block table from one KV
        head's caches (`k_head`, `v_head`); `WHOLE`: a tile's keys lie in one block."""
        token = first + tl.arange(0, TILE)
        held = token < end
        if WHOLE:  # the tile lies in one block: `first` is a multiple of TILE (or the row one block)
            block = tl.load(row_table + first // block_tokens).to(tl.int64)
            slot = first % block_tokens + tl.arange(0, TILE)
        else:
            block = tl.load(row_table + token // block_tokens, mask=held, other=0).to(tl.int64)
            slot = token % block_tokens
        dims = tl.arange(0, D)
        at_k = block * stride_kb + slot * stride_kt
        key = tl.load(k_head + at_k[:, None] + dims[None, :], mask=held[:, None], other=0.0)
        score = tl.where(held[None, :], tl.dot(query, tl.trans(key)) * scale_log2, float("-inf"))
        new_top = tl.maximum(top, tl.max(score, axis=1))
        p = tl.exp2(score - new_top[:, None])
        kept = tl.exp2(top - new_top)
        at_v = block * stride_vb + slot * stride_vt
        value = tl.load(v_head + at_v[:, None] + dims[None, :], mask=held[:, None], other=0.0)
        acc = acc * kept[:, None] + tl.dot(p.to(value.dtype), value)
        return new_top, total * kept + tl.sum(p, axis=1), acc

    @triton.jit
    def _partials(
        q,
        k_cache,
        v_cache,
        table,
        seqlens,
        out,
        lse,
        part_out,
        part_max,
        part_sum,
        stride_qr,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        stride_table,
        scale_log2,
        queries,
        block_tokens,
        CAUSAL: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        D: tl.constexpr,
        TILE: tl.constexpr,
        SPLITS: tl.constexpr,
        STEPPED: tl.constexpr,
        WHOLE: tl.constexpr,
    ):
        """One query row's heads of one KV head over one split of its keys: with SPLITS 1 the
        normalised output and logsumexp, else the split's unnormalised sum, max and total
        (scores in log2 units) for `_combine`."""
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        request = row // queries
        keys = tl.load(seqlens + request)
        if CAUSAL:
            keys -= queries - 1 - row % queries
        # Each split an equal share of this row's own keys (whole tiles), not of the table's width.
        share = tl.cdiv(tl.cdiv(keys, SPLITS), TILE) * TILE
        start = split * share
        end = tl.minimum(start + share, keys)
        lane = tl.arange(0, GROUP_PAD)
        heads = kv_head * GROUP + lane
        in_group = lane < GROUP
        dims = tl.arange(0, D)
        query = tl.load(
            q + row * stride_qr + heads[:, None] * stride_qh + dims[None, :],
            mask=in_group[:, None],
            other=0.0,
        )
        query = query.to(k_cache.dtype.element_ty)
        top = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        total = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, D), tl.float32)
        k_head = k_cache + kv_head * stride_kh
        v_head = v_cache + kv_head * stride_vh
        row_table = table + request * stride_table
        # Every tile holds a key of the row (start < end), so `top` is finite after the first.
        if STEPPED:
            first = start
            while first < end:
                top, total, acc = _tile(
                    query, k_head, v_head, row_table, first, end, block_tokens, stride_kb, stride_kt,
                    stride_vb, stride_vt, scale_log2, top, total, acc, D, TILE, WHOLE,
                )  # fmt: skip
                first += TILE
        else:
            for first in range(start, end, TILE):
                top, total, acc = _tile(
                    query, k_head, v_head, row_table, first, end, block_tokens, stride_kb, stride_kt,
                    stride_vb, stride_vt, scale_log2, top, total, acc, D, TILE, WHOLE,
                )  # fmt: skip
        if SPLITS == 1:
            at = row * GROUP * tl.num_programs(1) + heads
            tl.store(
                out + at[:, None] * D + dims[None, :],
                (acc / tl.where(total > 0, total, 1.0)[:, None]).to(out.dtype.element_ty),
                mask=in_group[:, None],
            )
            tl.store(lse + at, _logsumexp(top, total), mask=in_group)
        else:
            at = (row * GROUP * tl.num_programs(1) + heads) * SPLITS + split
            tl.store(part_out + at[:, None] * D + dims[None, :], acc, mask=in_group[:, None])
            tl.store(part_max + at, top, mask=in_group)
            tl.store(part_sum + at, total, mask=in_group)

    @triton.jit
    def _combine(part_out, part_max, part_sum, out, lse, D: tl.constexpr, SPLITS: tl.constexpr):
        """One query row's head: its splits' partial sums merged into the output and logsumexp."""
        at = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        part = at * SPLITS + tl.arange(0, SPLITS)
        tops = tl.load(part_max + part)
        top = tl.max(tops, axis=0)
        ref = tl.where(top == float("-inf"), 0.0, top)  # a row with no keys: every split empty
        weight = tl.exp2(tops - ref)
        total = tl.sum(tl.load(part_sum + part) * weight, axis=0)
        dims = tl.arange(0, D)
        acc = tl.sum(tl.load(part_out + part[:, None] * D + dims[None, :]) * weight[:, None], axis=0)
        tl.store(out + at * D + dims, (acc / tl.where(total > 0, total, 1.0)).to(out.dtype.element_ty))
        tl.store(lse + at, _logsumexp(ref, total))
