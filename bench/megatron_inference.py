"""The megatron part of `python -m bench.gpu --parts generate --megatron-inference`: megatron-core's
dynamic engine as `rollout.engine: megatron` builds it (`serve.build_inference`, for
`recipes/bench-h200-colocated.yaml` with the bench's batch and `rollout.graphs`), over a megatron
`GPTModel` holding the torch model's weights, on the same prompts (each a request of one row, no
stop token): its tokens/s, each engine step's wall time, its logprobs against the recomputed ones,
then its stand-down (`suspend()`) and wake (`resume()`) through the adapter as the gate times
them, with the bytes each stand-down gave back to the driver.

Each variant (`--megatron-variants SCHEDULE+SAMPLER,...`, `serve.Serving`) builds its own model
and engine: SCHEDULE is megatron's `async` schedule (the pipeline's) or its `legacy` one, SAMPLER
`race` (`backends/megatron/sampling.py`, the pipeline's), `fused` (the same with the torch
engine's one-pass CUDA kernel on steps it fits, as this batch's) or `megatron` (its
`TorchSampling`, whose draw waits for the GPU; same logprobs on this batch, temperature 1 with no
top-p).

Without graphs only the first call is timed (nothing is captured or compiled in it) and the
handoffs are megatron's recompute ones, also timed with megatron's own `delete_cuda_graphs` in
`suspend()` beside (`megatron_suspend`, what `serve.install_suspend` replaces).
`--megatron-profile`: one more call with the engine's steps under cProfile, its top functions
printed. `--megatron-trace N`: one more call with N of its decode steps (from step 64) under
torch.profiler: per step the wall time, the GPU's busy time (kernels and copies) and the host's
time blocked in CUDA synchronisations, so wall - device busy is what the GPU waited for the
host; the trace is written beside `--out` (`megatron-trace-NAME.json.gz`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import pstats
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from megatron.core.inference.config import AsyncScheduleMode
from megatron.core.inference.engines import dynamic_engine as engine_module
from megatron.core.transformer import cuda_graphs

import pipeline
from backends.megatron import layout, parallel
from backends.megatron.model import build_gpt_model
from backends.megatron.serve import SERVING, Serving, build_inference
from backends.torch.config import ModelConfig
from backends.torch.model import Decoder
from pipeline.contracts.messages import Completion
from pipeline.shell.backend_input import backend_input

TRACE_FROM_STEP = 64  # past the prefill steps, well before the batch ends


def variant(text: str) -> Serving:
    """`SCHEDULE+SAMPLER` (`async+race`, as bench.gpu's `--megatron-variants` checked it) as
    `serve.Serving`."""
    schedule, _, sampler = text.partition("+")
    return Serving(schedule=AsyncScheduleMode(schedule), sampler=sampler)


def name(serving: Serving, *, graphs: bool, attention: str = "adapter") -> str:
    """The result's key: `megatron_inference` for the pipeline's serving with graphs and the
    adapter's attention, else with the variant (`_legacy_megatron`), `_fa4` (flash-attn-4's
    kernels) and `_eager` appended."""
    key = "megatron_inference"
    if serving != SERVING:
        key += f"_{serving.schedule.value}_{serving.sampler}"
    if attention == "flash-attn-4":
        key += "_fa4"
    return key if graphs else key + "_eager"


def _sync_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


@contextlib.contextmanager
def _around_steps(engine: Any, before: Callable[[int], None], after: Callable[[int], None]) -> Iterator[None]:
    """Call `before(k)` and `after(k)` around the engine's k-th step (from 0; on the engine's
    thread) while the block runs."""
    step = engine.engine.step_modern
    count = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        k = count[0]
        count[0] += 1
        before(k)
        try:
            return step(*args, **kwargs)
        finally:
            after(k)

    engine.engine.step_modern = wrapped
    try:
        yield
    finally:
        engine.engine.step_modern = step


def run(
    model: Decoder,
    config: ModelConfig,
    prompts: list[list[int]],
    args: argparse.Namespace,
    *,
    graphs: bool,
    serving: Serving,
    mismatch: Callable[[list[Completion]], dict[str, float]],
    attention: str = "adapter",
) -> dict[str, Any]:
    """One variant, timed (module docstring); `mismatch` compares its completions' logprobs with
    the recomputed ones."""
    device = torch.device("cuda", torch.cuda.current_device())
    parallel.initialise(device=device)
    gpt = build_gpt_model(config, dtype=torch.bfloat16, device=device)
    layout.load_hf(gpt, model.state_dict(), config)
    recipe = pipeline.load_recipe(
        "recipes/bench-h200-colocated.yaml",
        [
            "train.backend=megatron",
            "rollout.engine=megatron",
            f"rollout.max_new_tokens={args.new_tokens}",
            f"rollout.samples_per_prompt={args.samples_per_prompt}",
            f"prompts.prompts_per_step={args.batch // args.samples_per_prompt}",
            f"rollout.graphs={str(graphs).lower()}",
            f"rollout.attention={attention}",
        ],
    )
    start = _sync_time()
    engine = build_inference(gpt, config, backend_input(recipe), stop_ids=(), device=device, serving=serving)
    build = _sync_time() - start  # with graphs: their capture

    async def generate() -> tuple[float, list[Completion]]:
        start = _sync_time()
        answers = await asyncio.gather(*(engine.generate(p, 1) for p in prompts))
        return _sync_time() - start, [c for (c,) in answers]

    def timed_steps() -> tuple[float, list[Completion], list[float]]:
        """A call, with each engine step's wall time (s)."""
        started: dict[int, float] = {}
        steps: list[float] = []
        with _around_steps(
            engine,
            lambda k: started.__setitem__(k, time.perf_counter()),
            lambda k: steps.append(time.perf_counter() - started[k]),
        ):
            seconds, outs = asyncio.run(generate())
        return seconds, outs, steps

    async def handoffs() -> list[tuple[float, float, int]]:
        """(stand-down s, wake s, bytes the stand-down gave back to the driver) per cycle: torch's
        reserved bytes, and the KV cache's where it is not torch's (graphs: a virtual memory
        pool)."""
        times = []
        for _ in range(args.repeats):
            reserved = torch.cuda.memory_reserved()
            held = engine.memory_in_use() if graphs else 0
            start = _sync_time()
            await engine.stand_down()
            down = _sync_time() - start
            released = reserved - torch.cuda.memory_reserved()
            if graphs:
                released += held - engine.memory_in_use()
            start = _sync_time()
            await engine.wake()
            times.append((down, _sync_time() - start, released))
        return times

    try:
        if graphs:  # the first call: each decode batch size's graph replayed once
            first = asyncio.run(generate())[0]
            runs = [timed_steps() for _ in range(args.repeats)]
        else:  # nothing captured or compiled in a first call: it is the timed one
            runs = [timed_steps()]
            first = runs[0][0]
        outs = runs[-1][1]
        tokens = sum(len(o.tokens) for o in outs)
        best = min(runs, key=lambda r: r[0])
        steps = sorted(best[2])
        memory = engine.memory_in_use()
        handoff = asyncio.run(handoffs())
        result: dict[str, Any] = {
            "schedule": serving.schedule.value,
            "sampler": serving.sampler,
            "build_s": build,
            "first_call_s": first,
            "call_s": [r[0] for r in runs],
            "steps": len(steps),
            "step_ms_median": 1000 * steps[len(steps) // 2],
            "step_ms_p90": 1000 * steps[int(0.9 * (len(steps) - 1))],
        }
        if not graphs:
            # megatron's own suspend, as it was before `serve.install_suspend`, side by side.
            with mock.patch.object(engine_module, "delete_cuda_graphs", cuda_graphs.delete_cuda_graphs):
                handoff_megatron = asyncio.run(handoffs())
            result["megatron_suspend"] = {
                "stand_down_ms": [1000 * d for d, _, _ in handoff_megatron],
                "wake_ms": [1000 * w for _, w, _ in handoff_megatron],
                "released_bytes": [r for _, _, r in handoff_megatron],
            }
        else:
            result["call_after_wakes_s"] = asyncio.run(generate())[0]
        if args.megatron_profile:
            result["profiled_call_s"] = _profiled(engine, lambda: asyncio.run(generate())[0])
        if args.megatron_trace:
            path = Path(args.out).with_name(
                f"megatron-trace-{name(serving, graphs=graphs, attention=attention)}.json.gz"
            )
            result["trace"] = _traced(engine, lambda: asyncio.run(generate()), args.megatron_trace, path)
    finally:
        engine.close()
    result |= {
        "tokens": tokens,
        "tokens_per_s": tokens / best[0],
        "kv_cache_bytes": memory,
        "stand_down_ms": [1000 * d for d, _, _ in handoff],
        "wake_ms": [1000 * w for _, w, _ in handoff],
        "released_bytes": [r for _, _, r in handoff],
        "mismatch": mismatch(outs),
    }
    print(name(serving, graphs=graphs, attention=attention), json.dumps(result), flush=True)
    del gpt
    torch.cuda.empty_cache()
    return result


def _profiled(engine: Any, call: Callable[[], float]) -> float:
    """`call()` with the megatron engine's steps under cProfile (on the engine's thread, which
    steps it); prints the functions with the most time, cumulative and own."""
    profile = cProfile.Profile()
    with _around_steps(engine, lambda k: profile.enable(), lambda k: profile.disable()):
        seconds = call()
    stats = pstats.Stats(profile)
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(25)
    return seconds


def _traced(engine: Any, call: Callable[[], Any], count: int, path: Path) -> dict[str, Any]:
    """`call()` with the engine's steps `TRACE_FROM_STEP` to `TRACE_FROM_STEP + count` under
    torch.profiler (started and stopped on the engine's thread, between two steps): per step
    figures (`step_figures`), the top operations printed, the trace written to `path`."""
    profiler = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    )
    window: list[float] = []

    def before(k: int) -> None:
        if k == TRACE_FROM_STEP:
            torch.cuda.synchronize()
            profiler.start()
            window.append(time.perf_counter())

    def after(k: int) -> None:
        if k == TRACE_FROM_STEP + count - 1:
            torch.cuda.synchronize()
            window.append(time.perf_counter())
            profiler.stop()

    with _around_steps(engine, before, after):
        call()
    assert len(window) == 2, f"the call took fewer than {TRACE_FROM_STEP + count} steps"
    events = profiler.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=30), flush=True)
    profiler.export_chrome_trace(str(path))
    return {"from_step": TRACE_FROM_STEP, **step_figures(events, count, window[1] - window[0])}


SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


def step_figures(events: Any, steps: int, wall_s: float) -> dict[str, float]:
    """Per step, from a profile's averaged events over `steps` steps taking `wall_s`: wall time,
    the GPU's busy time (its kernels and copies, device events only: each op's own device time
    is also counted on its kernels), the GPU's idle time (wall - busy: its wait for the host),
    and the host's time blocked in CUDA synchronisations (its wait for the GPU)."""
    device_us = sum(
        e.self_device_time_total
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation
    )
    sync_us = sum(e.self_cpu_time_total for e in events if e.key in SYNCS)
    wall_ms = 1000 * wall_s / steps
    return {
        "steps": steps,
        "wall_ms_per_step": wall_ms,
        "device_busy_ms_per_step": device_us / 1000 / steps,
        "device_idle_ms_per_step": wall_ms - device_us / 1000 / steps,
        "host_sync_wait_ms_per_step": sync_us / 1000 / steps,
    }
