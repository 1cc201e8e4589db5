"""`backends/torch/paged_decode.py`'s kernels compiled for the GPU, in megatron's engine shape
for the 1.5B model (12 query heads, 2 KV heads, head dim 128, 256-token blocks, bf16), against
attention written out and against the flash adapter's gather, eager and replayed from a CUDA
graph for lengths other than the captured ones."""

from __future__ import annotations

import pytest
import torch

from backends.megatron import flash_adapter
from backends.torch import paged_decode
from tests.backends.paged_decode_case import paged, reference

pytestmark = pytest.mark.gpu

BLOCK, KV_HEADS, HEADS = 256, 2, 12
LENGTHS = [1, 300, 777, 256, 0, 513]


def _inputs(lengths: list[int], d: int, s: int = 1, block: int = BLOCK):
    torch.manual_seed(0)
    k, v, table = paged(
        lengths, block_tokens=block, kv_heads=KV_HEADS, d=d, dtype=torch.bfloat16, device="cuda"
    )
    q = torch.randn(len(lengths), s, HEADS, d, device="cuda", dtype=torch.bfloat16)
    return q, k, v, table, torch.tensor(lengths, dtype=torch.int32, device="cuda")


def _close(out: torch.Tensor, lse: torch.Tensor, want: tuple[torch.Tensor, torch.Tensor]) -> None:
    want_out, want_lse = want
    torch.testing.assert_close(out.double(), want_out, atol=2e-2, rtol=2e-2)
    seen = want_lse.isfinite()
    assert torch.equal(lse.isfinite(), seen)
    torch.testing.assert_close(lse.double()[seen], want_lse[seen], atol=1e-2, rtol=1e-3)


@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("splits", [None, 1, 4])
@pytest.mark.parametrize(("s", "causal"), [(1, True), (2, True), (2, False)])
def test_the_kernel_gives_softmax_attention_over_each_rows_blocks(
    d: int, splits: int | None, s: int, causal: bool
) -> None:
    q, k, v, table, seqlens = _inputs(LENGTHS, d, s)
    out, lse = paged_decode.attend(q, k, v, table, seqlens, d**-0.5, causal, num_splits=splits)
    _close(out, lse, reference(q, k, v, table, LENGTHS, d**-0.5, causal))


@pytest.mark.parametrize(("block", "tile"), [(256, 128), (48, 64), (48, 128), (1000, 128)])
@pytest.mark.parametrize("splits", [1, 4])
def test_each_tile_reads_its_keys_within_a_block_or_across_blocks(block: int, tile: int, splits: int) -> None:
    """128-key tiles over 256-key blocks (a tile's block number read once), 48-key blocks (a
    tile's keys span blocks: each key's block number read), and the torch engine's layout (one
    block of 1,000 keys a row, a table of one column): bf16, split and not."""
    q, k, v, table, seqlens = _inputs(LENGTHS, 128, block=block)
    if block == 1000:  # each row its own block, in order
        table = torch.arange(len(LENGTHS), dtype=torch.int32, device="cuda").view(-1, 1)
        k, v = k[: len(LENGTHS)], v[: len(LENGTHS)]
    out, lse = paged_decode.attend(
        q, k, v, table, seqlens, 128**-0.5, True, num_splits=splits, keys_a_tile=tile
    )
    _close(out, lse, reference(q, k, v, table, LENGTHS, 128**-0.5, True))


def test_the_adapter_decodes_through_the_kernel_as_the_gather_does() -> None:
    lengths = [n for n in LENGTHS if n]  # the gather's flash kernel wants a key a row
    q, k, v, table, seqlens = _inputs(lengths, 128)
    assert paged_decode.supports(q, k, v, table, seqlens)
    out = flash_adapter.flash_attn_with_kvcache(
        q, k, v, cache_seqlens=seqlens, causal=True, block_table=table
    )
    gathered, _ = flash_adapter.gathered_decode(q, k, v, table, seqlens, 128**-0.5, True)
    torch.testing.assert_close(out.float(), gathered.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("s", "causal"), [(1, True), (2, True), (2, False)])
def test_the_gather_gives_the_logsumexp_as_flash_attn_lays_it_out(s: int, causal: bool) -> None:
    """[B, H, S], as the kernel's and flash-attn's (the path of head dims the kernel refuses,
    and of CUDA without Triton): megatron's sink-softmax correction reads it so."""
    lengths = [n for n in LENGTHS if n > 1]  # every query sees a key: flash-attn's lse is finite
    q, k, v, table, seqlens = _inputs(lengths, 128, s)
    out, lse = flash_adapter.gathered_decode(q, k, v, table, seqlens, 128**-0.5, causal)
    assert lse.shape == (len(lengths), HEADS, s)
    _close(out, lse, reference(q, k, v, table, lengths, 128**-0.5, causal))


@pytest.mark.parametrize("rows", [2, 1024])
def test_a_captured_launch_replays_for_other_lengths(rows: int) -> None:
    """Captured once (keys split for 2 rows, whole for 1,024: 2,048 pairs of 128-key tiles are
    past four programs an SM on the H200's 132 SMs) at one key a row, replayed after the rows
    grew: the replay attends over each row's keys as they are then."""
    grown = [(37 * i) % 1000 + 1 for i in range(rows)]
    q, k, v, table, seqlens = _inputs(grown, 128)
    assert (paged_decode.splits(rows * KV_HEADS, table.shape[1] * BLOCK, q.device) > 1) == (rows == 2)
    seqlens.fill_(1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compile) off the capture, as torch asks
        paged_decode.attend(q, k, v, table, seqlens, 128**-0.5, True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = paged_decode.attend(q, k, v, table, seqlens, 128**-0.5, True)
    seqlens.copy_(torch.tensor(grown, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    _close(out, lse, reference(q, k, v, table, grown, 128**-0.5, True))
