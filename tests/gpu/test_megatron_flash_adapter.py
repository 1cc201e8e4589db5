"""The flash-attn functions megatron's dynamic engine calls (decode through the Triton kernel,
prefill and the gather over torch's flash kernel) against attention written out over the same
paged cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backends.megatron.flash_adapter import flash_attn_varlen_func, flash_attn_with_kvcache, gathered_decode

pytestmark = pytest.mark.gpu

BLOCK, KV_HEADS, HEADS, D = 256, 2, 12, 128


def _paged(lengths: list[int], blocks: int = 40):
    torch.manual_seed(0)
    k = torch.randn(blocks, BLOCK, KV_HEADS, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    order = torch.randperm(blocks, device="cuda")  # requests' blocks scattered in the pool
    width = max(-(-n // BLOCK) for n in lengths)
    table = torch.full((len(lengths), width), -1, dtype=torch.int32, device="cuda")
    taken = 0
    for row, n in enumerate(lengths):
        count = -(-n // BLOCK)
        table[row, :count] = order[taken : taken + count]
        taken += count
    return k, v, table


def _reference(q: torch.Tensor, k, v, table, row: int, n: int, causal: bool) -> torch.Tensor:
    """Queries [S, H, D] of request `row` (the last S of its n positions) over its keys."""
    blocks = table[row][table[row] >= 0].long()
    keys, values = (c[blocks].flatten(0, 1)[:n] for c in (k, v))
    s = q.shape[0]
    mask = None
    if causal:
        mask = torch.arange(n, device="cuda")[None, :] <= torch.arange(n - s, n, device="cuda")[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(),
        keys.transpose(0, 1).float(),
        values.transpose(0, 1).float(),
        attn_mask=mask,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def test_decode_over_a_paged_cache() -> None:
    lengths = [1, 300, 777, 256]
    k, v, table = _paged(lengths)
    q = torch.randn(len(lengths), 1, HEADS, D, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out = flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=True, block_table=table)
    for row, n in enumerate(lengths):
        torch.testing.assert_close(
            out[row].float(), _reference(q[row], k, v, table, row, n, True), atol=2e-2, rtol=2e-2
        )


def test_prefill_chunks_over_a_paged_cache() -> None:
    lengths, new = [129, 512, 40], [129, 64, 1]  # query counts: a fresh prompt, a chunk, a decode
    k, v, table = _paged(lengths)
    q = torch.randn(sum(new), HEADS, D, device="cuda", dtype=torch.bfloat16)
    cu_q = F.pad(torch.tensor(new, device="cuda").cumsum(0), (1, 0)).to(torch.int32)
    cu_k = F.pad(torch.tensor(lengths, device="cuda").cumsum(0), (1, 0)).to(torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(new), max(lengths), causal=True, block_table=table)
    for row, n in enumerate(lengths):
        rows = slice(int(cu_q[row]), int(cu_q[row + 1]))
        torch.testing.assert_close(
            out[rows].float(), _reference(q[rows], k, v, table, row, n, True), atol=2e-2, rtol=2e-2
        )


def test_a_block_table_as_wide_as_megatrons_gives_the_same_attention() -> None:
    """megatron's table has a column for each block of its longest possible sequence: the
    unused ones (-1) are not gathered, and change nothing (the decode kernel, which never reads
    them, may split a wider table's rows otherwise: the same attention within rounding)."""
    lengths = [1, 300, 777, 256]
    k, v, table = _paged(lengths)
    wide = F.pad(table, (0, 60), value=-1)  # a 16k-token context's width
    q = torch.randn(len(lengths), 1, HEADS, D, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out = flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=True, block_table=wide)
    for row, n in enumerate(lengths):
        torch.testing.assert_close(
            out[row].float(), _reference(q[row], k, v, table, row, n, True), atol=2e-2, rtol=2e-2
        )
    cu = F.pad(seqlens.cumsum(0), (1, 0)).to(torch.int32)
    cu_q = torch.arange(len(lengths) + 1, dtype=torch.int32, device="cuda")
    flat = q.flatten(0, 1)
    narrow = flash_attn_varlen_func(flat, k, v, cu_q, cu, 1, max(lengths), causal=True, block_table=table)
    prefill = flash_attn_varlen_func(flat, k, v, cu_q, cu, 1, max(lengths), causal=True, block_table=wide)
    assert torch.equal(prefill, narrow)


@pytest.mark.parametrize("path", ["adapter", "gather"])
def test_a_decode_captured_in_a_cuda_graph_replays_for_other_lengths(path: str) -> None:
    """megatron's decode graphs capture this call once and replay it as the rows grow: the
    adapter's kernel reads each row's blocks as they are at the replay; the gather, where the
    kernel does not run, gathers every column of the table while captured (no sync). Either
    way a replay with longer rows attends over all their keys."""
    k, v, table = _paged([777, 777, 777, 777])
    q = torch.randn(4, 1, HEADS, D, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.tensor([1, 2, 3, 4], dtype=torch.int32, device="cuda")

    def decode() -> torch.Tensor:
        if path == "adapter":
            return flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=True, block_table=table)
        return gathered_decode(q, k, v, table, seqlens, D**-0.5, True)[0]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up off the capture, as torch asks
        decode()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode()
    lengths = [1, 300, 777, 256]
    seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    for row, n in enumerate(lengths):
        torch.testing.assert_close(
            out[row].float(), _reference(q[row], k, v, table, row, n, True), atol=2e-2, rtol=2e-2
        )
