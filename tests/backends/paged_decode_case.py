"""Paged KV caches as megatron's dynamic engine lays them out, attention written out over them,
and the CPU cases of `backends/torch/paged_decode.py`'s kernels.

`python -m tests.backends.paged_decode_case` with TRITON_INTERPRET=1 (Triton's interpreter runs
the kernels on CPU tensors; it must be on before Triton is first imported, so the test runs it
in a process of its own) prints one JSON object: for each case the largest difference of the
kernel's output and logsumexp from `reference`, and whether the two agree on the queries that
see no key. The cases are float32: Triton 3.6's interpreter gets `tl.dot` of bf16 tiles wrong
(products of order 1e10 from unit-scale inputs), so bf16 is tested on the GPU, by
tests/gpu/test_paged_decode_gpu.py, which takes the caches and the reference from here.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import Tensor


def paged(
    lengths: list[int],
    *,
    block_tokens: int,
    kv_heads: int,
    d: int,
    spare_blocks: int = 3,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> tuple[Tensor, Tensor, Tensor]:
    """Caches [blocks, block_tokens, kv_heads, d] and a block table for requests of `lengths`
    keys: each request's blocks scattered through the pool (not in order, not adjacent), the
    table two columns wider than the longest request and two rows longer than the batch, the
    unused entries -1, as megatron's."""
    counts = [-(-n // block_tokens) for n in lengths]
    blocks = sum(counts) + spare_blocks
    k = torch.randn(blocks, block_tokens, kv_heads, d, dtype=dtype, device=device)
    v = torch.randn_like(k)
    order = torch.randperm(blocks, device=device).to(torch.int32)
    table = torch.full((len(lengths) + 2, max(counts) + 2), -1, dtype=torch.int32, device=device)
    taken = 0
    for row, count in enumerate(counts):
        table[row, :count] = order[taken : taken + count]
        taken += count
    return k, v, table


def reference(
    q: Tensor, k: Tensor, v: Tensor, table: Tensor, lengths: list[int], scale: float, causal: bool
) -> tuple[Tensor, Tensor]:
    """Softmax attention in float64 of queries [B, S, H, D] over each request's gathered keys
    (query s sees the first n - (S - 1 - s) of n with `causal`): output [B, S, H, D] (0 where a
    query sees no key) and logsumexp [B, H, S] (-inf there)."""
    b, s, h, d = q.shape
    group = h // k.shape[2]
    out = torch.zeros(b, s, h, d, dtype=torch.float64, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float64, device=q.device)
    for row, n in enumerate(lengths):
        blocks = table[row][table[row] >= 0].long()
        keys, values = (c[blocks].flatten(0, 1)[:n].double().repeat_interleave(group, 1) for c in (k, v))
        for i in range(s):
            seen = n - (s - 1 - i) if causal else n
            if seen <= 0:
                continue
            scores = torch.einsum("hd,nhd->hn", q[row, i].double(), keys[:seen]) * scale
            lse[row, :, i] = scores.logsumexp(-1)
            out[row, i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values[:seen])
    return out, lse


# name: (lengths, block_tokens, kv_heads, query heads, head dim, queries a request, causal, splits,
# keys a tile)
CASES: dict[str, tuple[list[int], int, int, int, int, int, bool, int, int]] = {
    # GQA 3 query heads a KV head; lengths of 1 key, within a block, ending mid-block, exactly
    # one block, none (a padded row), several tiles of keys across blocks.
    "mixed_lengths_gqa": ([1, 37, 16, 0, 150], 16, 2, 6, 32, 1, True, 1, 64),
    "split_keys": ([1, 37, 16, 0, 150], 16, 2, 6, 32, 1, True, 4, 64),
    "two_queries_causal": ([2, 37, 1, 90], 16, 2, 4, 16, 2, True, 2, 64),
    "two_queries_full": ([2, 37, 1, 90], 16, 2, 4, 16, 2, False, 1, 64),
    "one_query_head_a_kv_head_dim_64": ([5, 70], 32, 2, 2, 64, 1, True, 1, 64),
    # Blocks of whole tiles (a tile's block read once): 64-key tiles in 128-key blocks, split
    # and not; 128-key tiles; one block a row, as the torch engine's cache rows are.
    "whole_tiles": ([1, 70, 0, 300, 128], 128, 2, 6, 32, 1, True, 2, 64),
    "whole_tiles_unsplit_causal_pair": ([2, 70, 1, 300], 128, 2, 4, 16, 2, True, 1, 64),
    "wide_tiles": ([1, 130, 0, 300, 256], 128, 2, 6, 32, 1, True, 2, 128),
    "one_block_a_row": ([3, 200, 0, 383, 64], 384, 2, 6, 32, 1, False, 4, 128),
}


def _compare(out: Tensor, lse: Tensor, want: tuple[Tensor, Tensor]) -> dict[str, Any]:
    want_out, want_lse = want
    seen = want_lse.isfinite()
    return {
        "out": (out.double() - want_out).abs().max().item(),
        "lse": (lse.double() - want_lse)[seen].abs().max().item(),
        "unseen_agree": torch.equal(lse.isfinite(), seen),
    }


def run() -> dict[str, Any]:
    from backends.megatron import flash_adapter
    from backends.torch import paged_decode

    results: dict[str, Any] = {}
    for name, (lengths, block_tokens, kv_heads, heads, d, s, causal, splits, tile) in CASES.items():
        torch.manual_seed(0)
        k, v, table = paged(lengths, block_tokens=block_tokens, kv_heads=kv_heads, d=d)
        q = torch.randn(len(lengths), s, heads, d)
        seqlens = torch.tensor(lengths, dtype=torch.int32)
        out, lse = paged_decode.attend(
            q, k, v, table, seqlens, d**-0.5, causal, num_splits=splits, keys_a_tile=tile
        )
        results[name] = _compare(out, lse, reference(q, k, v, table, lengths, d**-0.5, causal))
    # megatron's call: the adapter takes the kernel (the gather's torch flash kernel has no CPU
    # implementation), its default scale 1/sqrt(D).
    lengths = [3, 40, 0, 17]
    torch.manual_seed(1)
    k, v, table = paged(lengths, block_tokens=16, kv_heads=2, d=32)
    q = torch.randn(len(lengths), 1, 6, 32)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    out, lse = flash_adapter.flash_attn_with_kvcache(
        q, k, v, cache_seqlens=seqlens, causal=True, block_table=table, return_softmax_lse=True, num_splits=0
    )
    results["adapter"] = _compare(out, lse, reference(q, k, v, table, lengths, 32**-0.5, True))
    results["engine_rows"] = _engine_rows(paged_decode)
    results["busy_splits"] = _busy_splits(paged_decode)
    results["whole"] = _whole(paged_decode)
    return results


def _engine_rows(paged_decode: Any) -> dict[str, Any]:
    """The torch engine's layout: each row one block of the cache's length (200 keys, not a
    multiple of the 64-key tile), a table of one column; the worst of unsplit and four splits."""
    lengths = [3, 150, 0, 200, 64]
    torch.manual_seed(3)
    k = torch.randn(len(lengths), 200, 2, 32)
    v = torch.randn_like(k)
    table = torch.arange(len(lengths), dtype=torch.int32).view(-1, 1)
    q = torch.randn(len(lengths), 1, 6, 32)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    want = reference(q, k, v, table, lengths, 32**-0.5, False)
    got = [
        _compare(*paged_decode.attend(q, k, v, table, seqlens, 32**-0.5, False, n, keys_a_tile=64), want)
        for n in (1, 4)
    ]
    return {
        "out": max(g["out"] for g in got),
        "lse": max(g["lse"] for g in got),
        "unseen_agree": all(g["unseen_agree"] for g in got),
    }


def _whole(paged_decode: Any) -> dict[str, bool]:
    """Whether `attend` launched `_partials` reading a tile's block number once (WHOLE), for
    blocks of whole 64-key tiles, of part tiles (16 and 96 keys) over several columns, and one
    block of 200 keys a row."""
    launched: list[bool] = []
    partials = paged_decode._partials

    class Spy:
        def __getitem__(self, grid: tuple[int, int, int]) -> Any:
            def launch(*args: Any, **kw: Any) -> Any:
                launched.append(kw["WHOLE"])
                return partials[grid](*args, **kw)

            return launch

    paged_decode._partials = Spy()
    try:
        for block_tokens in (128, 16, 96):
            k, v, table = paged([5, 140], block_tokens=block_tokens, kv_heads=2, d=16)
            q = torch.randn(2, 1, 4, 16)
            seqlens = torch.tensor([5, 140], dtype=torch.int32)
            paged_decode.attend(q, k, v, table, seqlens, 0.25, False, keys_a_tile=64)
        k = torch.randn(2, 200, 2, 16)
        table = torch.arange(2, dtype=torch.int32).view(2, 1)
        paged_decode.attend(q, k, k, table, seqlens, 0.25, False, keys_a_tile=64)
    finally:
        paged_decode._partials = partials
    names = ["blocks_of_128", "blocks_of_16", "blocks_of_96", "one_block_of_200"]
    return dict(zip(names, launched, strict=True))


def _busy_splits(paged_decode: Any) -> list[int]:
    """Four splits over a table 640 keys wide, rows of 130, 10, 0 and 600 keys: how many of
    each row's splits (first query head) summed any key, read off what `_combine` merges."""
    lengths = [130, 10, 0, 600]
    torch.manual_seed(2)
    k, v, table = paged(lengths, block_tokens=16, kv_heads=2, d=16)
    q = torch.randn(len(lengths), 1, 4, 16)
    merged: list[Tensor] = []
    combine = paged_decode._combine

    class Spy:
        def __getitem__(self, grid: tuple[int, int]) -> Any:
            def launch(part_out: Tensor, part_max: Tensor, part_sum: Tensor, *rest: Any, **kw: Any) -> Any:
                merged.append(part_sum.clone())
                return combine[grid](part_out, part_max, part_sum, *rest, **kw)

            return launch

    paged_decode._combine = Spy()
    try:
        seqlens = torch.tensor(lengths, dtype=torch.int32)
        paged_decode.attend(q, k, v, table, seqlens, 0.25, False, num_splits=4)
    finally:
        paged_decode._combine = combine
    return (merged[0][:, 0, :] > 0).sum(-1).tolist()  # type: ignore[no-any-return]


if __name__ == "__main__":
    print(json.dumps(run()))
