"""`backends/torch/paged_decode.py`'s kernels against attention written out over the same
paged cache, on the CPU through Triton's interpreter (one process for every case:
tests/backends/paged_decode_case.py), and the choices it makes on the host."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from backends.torch import paged_decode  # noqa: E402
from tests.backends.interpreted import run_interpreted  # noqa: E402
from tests.backends.paged_decode_case import CASES, paged  # noqa: E402


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    return run_interpreted("tests.backends.paged_decode_case")  # type: ignore[no-any-return]


@pytest.mark.parametrize("case", [*CASES, "adapter", "engine_rows"])
def test_the_kernel_gives_softmax_attention_over_each_rows_own_blocks(
    interpreted: dict[str, Any], case: str
) -> None:
    """Mixed lengths (1 key, mid-block, a whole block, none, several tiles over scattered
    blocks), GQA, keys split over programs, two queries a request with and without the causal
    cut, head dim 64, blocks of whole 64- and 128-key tiles, the torch engine's rows (one block
    a row, its length no multiple of the tile), and the flash adapter's
    `flash_attn_with_kvcache` taking the kernel: the output and logsumexp of plain softmax
    attention; a query that sees no key has logsumexp -inf and output 0."""
    got = interpreted[case]
    assert got["out"] < 1e-5 and got["lse"] < 1e-5, got
    assert got["unseen_agree"], got


def test_each_split_takes_an_equal_share_of_its_rows_own_keys(interpreted: dict[str, Any]) -> None:
    """Four splits over a table 640 keys wide: a 130-key row's keys spread over three splits of
    one 64-key tile each (a quarter of 130, in whole tiles), not all in the first split's quarter
    of the table's width; a 600-key row over all four; a 10-key row in one; an empty row in none."""
    assert interpreted["busy_splits"] == [3, 1, 0, 4]


def test_a_tile_reads_its_block_number_once_where_its_keys_lie_in_one_block(
    interpreted: dict[str, Any],
) -> None:
    """Blocks of whole 64-key tiles and a table of one block a row take the kernel's path that
    reads a tile's block number once; blocks of 16 or 96 keys over several columns read it a
    key at a time (a tile's keys span blocks)."""
    assert interpreted["whole"] == {
        "blocks_of_128": True,
        "blocks_of_16": False,
        "blocks_of_96": False,
        "one_block_of_200": True,
    }


def _h200(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132)
    )
    return torch.device("cuda")


def test_a_batch_splits_its_keys_until_the_sms_are_full_for_its_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    """132 SMs: below WIDE_PAIRS (query row, KV head) pairs a program reads 64-key tiles and
    the keys split until 1,056 programs (eight an SM): 64 rows x 2 KV heads (128 pairs) in
    eight; from WIDE_PAIRS up 128-key tiles, until 528 programs (four an SM): 96 rows (192
    pairs) in two (2.75 rounded down to a power of two), 256 rows (512 pairs) in two, 1,024
    rows in one."""
    device = _h200(monkeypatch)
    assert [paged_decode.tile(pairs) for pairs in (2, 128, 190, 192, 2048)] == [64, 64, 64, 128, 128]
    assert paged_decode.splits(64 * 2, 2048, device) == 8
    assert paged_decode.splits(96 * 2, 1024, device) == 2
    assert paged_decode.splits(256 * 2, 1024, device) == 2
    assert paged_decode.splits(1024 * 2, 1024, device) == 1


def test_few_long_rows_split_their_keys_by_the_tables_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """2 pairs leave SMs idle: their keys are split in a power of two, each split at least
    MIN_SPLIT_KEYS of the width a row can hold, at most MAX_SPLITS; a table narrower than two
    splits is not split."""
    device = _h200(monkeypatch)
    assert paged_decode.splits(2, 1024, device) == 4
    assert paged_decode.splits(2, 1536, device) == 4  # 6 splits' worth: rounded down
    assert paged_decode.splits(2, 65536, device) == paged_decode.MAX_SPLITS
    assert paged_decode.splits(2, 256, device) == 1


def test_cpu_tensors_take_the_gather_without_the_interpreter() -> None:
    """The adapter's fallback: the kernel runs on CUDA tensors (or under Triton's interpreter)."""
    k, v, table = paged([5], block_tokens=16, kv_heads=2, d=32)
    q = torch.randn(1, 1, 6, 32)
    assert not paged_decode.supports(q, k, v, table, torch.tensor([5], dtype=torch.int32))


@pytest.mark.parametrize(
    ("heads", "d", "strided", "runs"),
    [
        (6, 32, False, True),
        (6, 96, False, False),
        (6, 512, False, False),
        (5, 32, False, False),
        (6, 32, True, False),
    ],
    ids=["gqa", "head-dim-96", "head-dim-512", "heads-not-a-multiple", "strided-head-dim"],
)
def test_inputs_the_kernel_cannot_take_go_to_the_gather(
    monkeypatch: pytest.MonkeyPatch, heads: int, d: int, strided: bool, runs: bool
) -> None:
    import triton

    monkeypatch.setattr(triton.knobs.runtime, "interpret", True)
    k, v, table = paged([5], block_tokens=16, kv_heads=2, d=d)
    q = torch.randn(1, 1, heads, 2 * d)[..., ::2] if strided else torch.randn(1, 1, heads, d)
    assert paged_decode.supports(q, k, v, table, torch.tensor([5], dtype=torch.int32)) == runs


@pytest.mark.parametrize(
    ("tile", "whole"),
    [(64, True), (128, True), (64, False)],
    ids=["tile-64", "tile-128", "keys-across-blocks"],
)
def test_the_kernel_compiles_for_the_h200_with_pipelined_vector_loads(tile: int, whole: bool) -> None:
    """What the interpreter cannot show: `_partials` compiles for sm_90 (megatron's engine shape:
    6 query heads a KV head, head dim 128, bf16), at each tile and with the block read a tile or
    a key, and with the cache's pointers and strides
    multiples of 16 (as a launch over megatron's cache specialises them) its key and value
    tiles are read by asynchronous copies (`cp.async`: loads of later tiles overlap the
    current tile's math) in 16-byte vectors."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = paged_decode._partials
    constants = {"CAUSAL": True, "GROUP": 6, "GROUP_PAD": 16, "D": 128, "TILE": tile}
    constants |= {"SPLITS": 1, "STEPPED": False, "WHOLE": whole}
    pointers = {"q": "*bf16", "k_cache": "*bf16", "v_cache": "*bf16", "out": "*bf16", "part_out": "*bf16"}
    pointers |= {"table": "*i32", "seqlens": "*i32", "lse": "*fp32", "part_max": "*fp32", "part_sum": "*fp32"}
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constants else pointers.get(n, "i32") for n in names}
    signature["scale_log2"] = "fp32"
    aligned = [i for i, n in enumerate(names) if signature[n] in ("*bf16", "*i32", "*fp32", "i32")]
    source = ASTSource(
        kernel,
        signature,
        {(names.index(n),): v for n, v in constants.items()},
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned if names[i] != "queries"},
    )
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert "cp.async" in ptx and "ld.global.v4" in ptx
