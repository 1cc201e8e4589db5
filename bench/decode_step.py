"""GPU microbenchmark: the sampler's whole decode step (`DecodeSteps`, as the engine captures and
replays it) on the Qwen2.5-1.5B shape, by width, with the keys a long-tailed loop holds.

For each width in ``--widths`` (a graph bucket), one step over a cache of ``--length`` positions
(the long-tail recipe's 128-token prompts plus 2,048 new tokens), each row at a position drawn
as a long-tailed loop holds its rows at a random moment: a response length drawn lognormal
(``--median``, ``--sigma``, capped at the new tokens), a row picked in proportion to its length
(a longer row is live for more steps), and a point uniform over its life after the prompt.
``--fixed N`` puts every row at position N instead. Prints one JSON object: milliseconds a step
(the median of ``--repeats`` replays) by width, and with ``--profile`` each kernel's share of
``--profile-steps`` replays at the widest width (torch.profiler), grouped by kernel name, with
the kernels' summed time against the replays' wall time.

    python -m bench.decode_step [--widths 8,64,128,256] [--profile] [--fixed 640]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any

import torch

from backends.torch.decode_step import DecodeSteps
from backends.torch.kv_cache import KVCache
from backends.torch.kv_pool import make_pool
from bench.gpu import QWEN_1_5B, _model
from bench.paged_decode import timed_ms

PROMPT = 128


def positions(rows: int, args: argparse.Namespace, generator: torch.Generator) -> torch.Tensor:
    """Each row's position (keys written so far) at a random moment of a long-tailed loop."""
    if args.fixed:
        return torch.full((rows,), args.fixed, dtype=torch.long)
    new = args.length - PROMPT
    normal = torch.randn(64 * rows, generator=generator)
    lengths = (args.median * torch.exp(args.sigma * normal)).clamp(1, new)
    picked = lengths[torch.multinomial(lengths, rows, generator=generator)]
    return PROMPT + (torch.rand(rows, generator=generator) * picked).long()


def profile(steps: DecodeSteps, step: Any, count: int) -> dict[str, Any]:
    """Kernel time of ``count`` replays, by kernel name, and their wall time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    with profiler(activities=[ProfilerActivity.CUDA]) as prof:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(count):
            steps.run(step, 0)
        end.record()
        end.synchronize()
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name][0] += event.device_time / 1000 / count
            kernels[event.name][1] += 1
    total = sum(ms for ms, _ in kernels.values())
    ranked = sorted(kernels.items(), key=lambda item: -item[1][0])
    return {
        "wall_ms_a_step": start.elapsed_time(end) / count,
        "kernel_ms_a_step": total,
        "kernels_a_step": sum(n for _, n in kernels.values()) / count,
        "by_kernel": [
            {"name": name[:120], "ms_a_step": round(ms, 4), "calls_a_step": n / count}
            for name, (ms, n) in ranked[:40]
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--widths", default="8,64,128,256")
    parser.add_argument("--length", type=int, default=PROMPT + 2048, help="the cache's positions")
    parser.add_argument("--median", type=float, default=256.0)
    parser.add_argument("--sigma", type=float, default=0.9)
    parser.add_argument("--fixed", type=int, default=0, help="every row at this position instead")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-steps", type=int, default=20)
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    model = _model("float32")
    cache = KVCache(QWEN_1_5B, torch.bfloat16, make_pool(torch.device("cuda")), zero_fresh=False)
    cache.grow(max(widths), args.length)
    for both in cache.flat:
        both.normal_()
    steps = DecodeSteps(model, cache, graphs=True, flash=True, compiled=True, eager_rounding=False)
    generator = torch.Generator().manual_seed(0)
    result: dict[str, Any] = {"shape": vars(args), "ms_a_step": {}, "mean_position": {}}
    with torch.inference_mode():
        for width in widths:
            step = steps.get(width, draws=True)
            where = positions(width, args, generator)
            step.position.copy_(where)
            step.token.random_(3, QWEN_1_5B.vocab_size)
            steps.run(step, 0)  # compiles and captures
            result["ms_a_step"][width] = timed_ms(lambda step=step: steps.run(step, 0), args.repeats)
            result["mean_position"][width] = where.float().mean().item()
            print(width, result["ms_a_step"][width], flush=True)
        if args.profile:
            result["profile"] = profile(steps, step, args.profile_steps)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
