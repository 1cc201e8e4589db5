"""GPU microbenchmark: one decode step's attention in megatron's dynamic engine, the flash
adapter's gather (`flash_adapter.gathered_decode`) against the Triton kernel
(`paged_decode.attend`).

The bench's batch as megatron's engine holds it for the 1.5B shape: `--rows` rows whose key
counts spread evenly over `--min-keys`..`--max-keys` (the bench's 128-token prompts through its
512 new tokens), 12 query heads over 2 KV heads of head dim 128, bf16, 256-token blocks (megatron's
default) scattered through the pool, a block table `--width` keys wide (the graphed engine's
`max_sequence_length`, 2 x 512 new tokens), and a cache of its own for each of `--layers` layers.
A step is one call a layer. Each path is timed eager (the gather then cuts the table to the
longest row, a host sync a layer) and replayed from one CUDA graph of the whole step, as
megatron's decode graphs replay it (the gather then copies every column of the table). Prints
one JSON object: milliseconds a step for each path and mode, the kernel's speed-up over the
gather, the splits the kernel chose and the largest difference between the two paths' outputs.

    python -m bench.paged_decode [--rows 256] [--min-keys 128] [--max-keys 640] [--layers 28] [--width 1024]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch

from backends.megatron import flash_adapter
from backends.torch import paged_decode

BLOCK_TOKENS, KV_HEADS, HEADS, HEAD_DIM = 256, 2, 12, 128


def _step_inputs(args: argparse.Namespace) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
    torch.manual_seed(0)
    lengths = torch.linspace(args.min_keys, args.max_keys, args.rows).round().to(torch.int32)
    columns = -(-args.width // BLOCK_TOKENS)
    blocks = args.rows * columns
    q = torch.randn(args.rows, 1, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    layers = []
    for _ in range(args.layers):
        k = torch.randn(blocks, BLOCK_TOKENS, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(blocks, device="cuda").to(torch.int32).view(args.rows, columns)
        layers.append((k, torch.randn_like(k), table, lengths.cuda()))
    return q, layers


def timed_ms(step: Callable[[], Any], repeats: int) -> float:
    """Milliseconds of `step`, the median of `repeats` calls after two warm-ups."""
    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graphed(step: Callable[[], Any]) -> Callable[[], Any]:
    """`step` captured in a CUDA graph (after one call off the capture): its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up off the capture
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--min-keys", type=int, default=128)
    parser.add_argument("--max-keys", type=int, default=640)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--width", type=int, default=1024, help="keys a block-table row can hold")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not args.min_keys <= args.max_keys <= args.width:
        parser.error("--min-keys <= --max-keys <= --width")
    q, layers = _step_inputs(args)
    scale = HEAD_DIM**-0.5
    paths = {
        "gather": lambda k, v, table, lengths: flash_adapter.gathered_decode(
            q, k, v, table, lengths, scale, True
        )[0],
        "kernel": lambda k, v, table, lengths: paged_decode.attend(q, k, v, table, lengths, scale, True)[0],
    }
    result: dict[str, Any] = {
        "shape": {
            **vars(args),
            "block_tokens": BLOCK_TOKENS,
            "kv_heads": KV_HEADS,
            "heads": HEADS,
            "d": HEAD_DIM,
        },
        "kernel_splits": paged_decode.splits(
            args.rows * KV_HEADS, layers[0][2].shape[1] * BLOCK_TOKENS, q.device
        ),
    }
    for name, attend in paths.items():

        def step(attend: Callable[..., torch.Tensor] = attend) -> list[torch.Tensor]:
            return [attend(*layer) for layer in layers]

        result[f"{name}_eager_ms"] = timed_ms(step, args.repeats)
        result[f"{name}_graph_ms"] = timed_ms(graphed(step), args.repeats)
    result["speedup_eager"] = result["gather_eager_ms"] / result["kernel_eager_ms"]
    result["speedup_graph"] = result["gather_graph_ms"] / result["kernel_graph_ms"]
    first = layers[0]
    gathered, kernel = (paths[name](*first).float() for name in ("gather", "kernel"))
    result["max_abs_difference"] = (gathered - kernel).abs().max().item()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
