"""The torch trainer's step on long-tailed responses beside fixed-length ones (issue 35), on one
CUDA device, without the engine: where a long-tailed step's training time goes.

A Qwen2.5-1.5B-shaped model (random weights, bf16, float32 residual, as
`recipes/bench-h200-long-tail.yaml`) and the real `TorchTrainer` (float32 masters, fused AdamW,
`train.compile`), stepping 32 groups of 8 samples of 128-token prompts:
- `fixed`: every response 512 tokens, micro-batches of 32 samples (`bench-h200-colocated.yaml`);
- `long_tail`: lengths drawn as `rollout.bench_lengths` draws them (lognormal, median 256,
  sigma 0.9, cut at 2048), micro-batches by `--micro-batch-tokens` (the long-tail recipe's);
- `long_tail@TOKENS`: the same under a budget of TOKENS (0: none);
each over `--steps` timed steps after `--warmup` (a fresh draw each step for `long_tail`).
Each variant reports trained tokens/s (the responses' own tokens), computed tokens, the median
step, dynamo's compiles, the allocator's retries (`num_alloc_retries`: a cudaMalloc that failed
and was retried after freeing the cache) and peak memory; `--empty-cache` empties torch's cache
before each step, as a colocated wake hands the trainer's cached blocks to the engine;
`--profile` adds the CUDA kernels' top lines for one more step of each.

    python -m bench.packed_train [--steps 5] [--variants fixed,long_tail] [--profile]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch

from backends.bench_lengths import LengthDraw
from backends.torch.section import TrainerOptions
from backends.torch.trainer import TorchTrainer
from bench.gpu import QWEN_1_5B, _model
from pipeline.algorithms.config import Algorithm
from pipeline.contracts.backend_input import Batching, Optimizer
from pipeline.contracts.messages import TrainGroup, TrainSample
from pipeline.contracts.sections import BenchLengths

PROMPTS, SAMPLES, PROMPT_TOKENS = 32, 8, 128


def _groups(lengths: list[int], rng: random.Random) -> list[TrainGroup]:
    vocab = QWEN_1_5B.vocab_size
    groups = []
    for g in range(PROMPTS):
        samples = []
        for i in range(SAMPLES):
            n = lengths[g * SAMPLES + i]
            samples.append(
                TrainSample(
                    tokens=tuple(rng.randrange(3, vocab) for _ in range(n)),
                    logprobs=tuple(-11.0 for _ in range(n)),
                    reward=float(i % 2),
                    advantage=1.0 if i % 2 else -1.0,
                )
            )
        prompt = tuple(rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS))
        groups.append(TrainGroup(group_id=f"0-{g}", prompt_tokens=prompt, samples=tuple(samples)))
    return groups


def _trainer(micro_batch_samples: int, micro_batch_tokens: int) -> TorchTrainer:
    model = _model("float32")
    return TorchTrainer(
        model,
        algorithm=Algorithm(),
        optimizer=Optimizer(
            lr=1e-6,
            betas=(0.9, 0.999),
            weight_decay=0.0,
            warmup_steps=0,
            schedule="constant",
            min_lr_ratio=0.1,
            grad_clip=1.0,
            total_steps=100,
        ),
        batching=Batching(
            micro_batch_samples=micro_batch_samples, micro_batch_tokens=micro_batch_tokens, updates_per_step=1
        ),
        options=TrainerOptions(compile=True),
        temperature=1.0,
        seed=0,
    )


def _variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    name, at, tokens = variant.partition("@")
    budget = int(tokens) if at else args.micro_batch_tokens  # long_tail@0: no budget

    rng = random.Random(0)
    draw = LengthDraw(
        BenchLengths(distribution="lognormal", median_tokens=256, sigma=0.9), max_new_tokens=2048, seed=0
    )

    def lengths() -> list[int]:
        if name == "fixed":
            return [512] * (PROMPTS * SAMPLES)
        return draw.draw(PROMPTS * SAMPLES)

    if name == "fixed":
        trainer = _trainer(32, 0)
    else:
        trainer = _trainer(256, budget)
    batches = [_groups(lengths(), rng) for _ in range(args.warmup + args.steps + 1)]
    for groups in batches[: args.warmup]:
        trainer._train_step(groups)
    torch.cuda.synchronize()
    frames_before = counters["stats"].get("unique_graphs", 0)
    retries_before = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    torch.cuda.reset_peak_memory_stats()
    steps, trained, computed = [], 0, 0
    for groups in batches[args.warmup : args.warmup + args.steps]:
        if args.empty_cache:
            torch.cuda.empty_cache()
        torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = trainer._train_step(groups)
        torch.cuda.synchronize()
        steps.append(time.perf_counter() - start)
        trained += int(metrics["train/tokens"])
        computed += int(metrics["train/computed_tokens"])
    result: dict[str, Any] = {
        "micro_batch_samples": trainer.micro_batch_samples,
        "micro_batch_tokens": trainer.micro_batch_tokens,
        "empty_cache_before_each_step": args.empty_cache,
        "steps": len(steps),
        "step_s": [round(s, 3) for s in steps],
        "step_s_median": statistics.median(steps),
        "trained_tokens_per_step": trained / len(steps),
        "computed_tokens_per_step": computed / len(steps),
        "trained_tokens_per_s": trained / sum(steps),
        "computed_tokens_per_s": computed / sum(steps),
        "new_dynamo_graphs_while_timed": counters["stats"].get("unique_graphs", 0) - frames_before,
        "alloc_retries_while_timed": torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries_before,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            trainer._train_step(batches[-1])
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.profile_rows)
        print(f"profile {name}\n{table}", flush=True)
        result["profile_top"] = table
    trainer.close()
    del trainer
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="fixed,long_tail")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--empty-cache", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-rows", type=int, default=25)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.packed_train needs a CUDA device (the 1.5B shape on one GPU)")
    results: dict[str, Any] = {"torch": torch.__version__, "command": "python -m bench.packed_train"}
    for name in args.variants.split(","):
        if name.partition("@")[0] not in ("fixed", "long_tail"):
            raise SystemExit(f"--variants: unknown variant {name!r} (fixed, long_tail, long_tail@TOKENS)")
        results[name] = _variant(name, args)
        shown = {k: v for k, v in results[name].items() if k != "profile_top"}
        print(name, json.dumps(shown), flush=True)
    for name in [n for n in results if n.startswith("long_tail")] if "fixed" in results else []:
        ratio = results[name]["trained_tokens_per_s"] / results["fixed"]["trained_tokens_per_s"]
        results[f"{name}_over_fixed_trained_tokens_per_s"] = ratio
        print(f"{name} / fixed trained tokens/s:", round(ratio, 3), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
