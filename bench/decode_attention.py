"""GPU microbenchmark: one layer's attention in the torch engine's decode step (`decode_step.py`),
`paged_decode.attend` over the `KVCache` layout against flash attention's variable-length kernel
(the path of head dims the Triton kernels do not take).

The 1.5B shape: 12 query heads over 2 KV heads of head dim 128, bf16, a cache of 256 rows of
2,176 positions (128-token prompts and 2,048 new tokens, `bench-h200-long-tail.yaml`), each row
one block of its keys. For each width (rows in the step) and each mix of key counts: ``c512``
and ``c1536`` (every row alike, as in a fixed-length batch), ``mix`` (uniform over
128..2,176) and ``long_tail`` (a decode loop over lognormal lengths, median 256, sigma 0.9,
capped at 2,048: rows drawn in proportion to their length, each at a uniform point of it, after
its 128-token prompt). Each path is replayed from a CUDA graph of 20 calls; the median of ten
replays, in microseconds a call. ``--against FILE`` times a second copy of `paged_decode.py`
(another commit's) beside this one, in the same process. Prints one JSON object.

    python -m bench.decode_attention [--against OTHER/backends/torch/paged_decode.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from backends.torch import paged_decode
from bench.paged_decode import graphed, timed_ms

ROWS, KV_HEADS, LENGTH, HEAD_DIM, HEADS = 256, 2, 2176, 128, 12
WIDTHS = (8, 16, 32, 64, 96, 128, 160, 192, 256)
MIXES = ("c512", "c1536", "mix", "long_tail")


def _key_counts(mix: str, rows: int, g: torch.Generator) -> torch.Tensor:
    if mix.startswith("c"):
        return torch.full((rows,), int(mix[1:]), dtype=torch.int32)
    if mix == "mix":
        return torch.randint(128, LENGTH, (rows,), generator=g, dtype=torch.int32)
    lengths = torch.exp(math.log(256) + 0.9 * torch.randn(20_000, generator=g)).clamp(1, 2048)
    picked = lengths[torch.multinomial(lengths, rows, replacement=True, generator=g)]
    return (128 + 1 + (torch.rand(rows, generator=g) * picked).long()).to(torch.int32)


def _replayed_us(call: Callable[[], Any], calls: int = 20) -> float:
    """Microseconds a call, ``calls`` of them captured in one graph (a replay's own cost spread
    over them), the median of ten replays."""
    return timed_ms(graphed(lambda: [call() for _ in range(calls)]), 10) * 1000 / calls


def _paged(
    module: ModuleType, q: torch.Tensor, cache: tuple[torch.Tensor, ...], used: torch.Tensor
) -> Callable[[], Any]:
    keys, values = cache
    rows = q.shape[0]
    table = torch.arange(rows, dtype=torch.int32, device="cuda").view(rows, 1)
    k, v = keys[:rows].transpose(1, 2), values[:rows].transpose(1, 2)  # as `_Decode` reads them
    return lambda: module.attend(q.view(rows, 1, HEADS, HEAD_DIM), k, v, table, used, HEAD_DIM**-0.5, False)[
        0
    ]


def _flash(q: torch.Tensor, cache: tuple[torch.Tensor, ...], used: torch.Tensor) -> Callable[[], Any]:
    keys, values = cache
    rows, group = q.shape[0], HEADS // KV_HEADS
    pairs = rows * KV_HEADS
    cu_q = torch.arange(0, (pairs + 1) * group, group, dtype=torch.int32, device="cuda")
    cu_k = torch.arange(0, (pairs + 1) * LENGTH, LENGTH, dtype=torch.int32, device="cuda")
    per_pair = used.view(rows, 1).expand(rows, KV_HEADS).reshape(-1).contiguous()
    k, v, flat_q = (
        keys[:rows].reshape(-1, 1, HEAD_DIM),
        values[:rows].reshape(-1, 1, HEAD_DIM),
        q.view(-1, 1, HEAD_DIM),
    )
    flash = torch.ops.aten._flash_attention_forward
    return lambda: flash(flat_q, k, v, cu_q, cu_k, group, LENGTH, 0.0, False, False, seqused_k=per_pair)[0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--against", help="another paged_decode.py, timed beside this one")
    args = parser.parse_args()
    other = None
    if args.against:
        spec = importlib.util.spec_from_file_location("paged_decode_against", args.against)
        assert spec is not None and spec.loader is not None
        other = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(other)
    cache = tuple(
        torch.randn(ROWS, KV_HEADS, LENGTH, HEAD_DIM, dtype=torch.bfloat16, device="cuda") for _ in range(2)
    )
    g = torch.Generator().manual_seed(0)
    results: dict[str, Any] = {}
    for mix in MIXES:
        for rows in WIDTHS:
            used = _key_counts(mix, rows, g).cuda()
            q = torch.randn(rows, HEADS * HEAD_DIM, dtype=torch.bfloat16, device="cuda")
            row: dict[str, Any] = {
                "mean_keys": round(float(used.float().mean()), 1),
                "splits": paged_decode.splits(rows * KV_HEADS, LENGTH, q.device),
                "paged_us": _replayed_us(_paged(paged_decode, q, cache, used)),
                "flash_us": _replayed_us(_flash(q, cache, used)),
            }
            if other is not None:
                row["against_us"] = _replayed_us(_paged(other, q, cache, used))
                row["against_splits"] = other.splits(rows * KV_HEADS, LENGTH, q.device)
            out = _paged(paged_decode, q, cache, used)().float()
            row["max_diff_from_flash"] = float(
                (out.view(rows, -1) - _flash(q, cache, used)().view(rows, -1).float()).abs().max()
            )
            results[f"{mix}/{rows}"] = row
            print(json.dumps({f"{mix}/{rows}": row}), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
