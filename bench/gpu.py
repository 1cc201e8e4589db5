"""GPU benchmarks on a Qwen2.5-1.5B-shaped model (random weights, bf16) on one CUDA device.

Parts (each can be picked with --parts):
- `generate`: 256 sequences x 512 new tokens from 128-token prompts with the `Sampler`
  (CUDA graphs of compiled decode steps; first call compiles and captures, then timed calls;
  `--uncompiled`/`--eager` also time graphs of uncompiled steps / no graphs), the prefill's
  share, and the engine/recompute mismatch metrics of the generated tokens (`token_logprobs`).
  `--bench-lengths MEDIAN,SIGMA` also times `long_tail`: `--stream-batches` batches' worth of
  (prompt, `--samples-per-prompt`) requests (32 x 8 = `--batch` rows each by default), each
  row ending at a length drawn as `rollout.bench_lengths` draws it (lognormal,
  `backends/bench_lengths.py`; the draw and its percentiles go into the results), up to
  `--new-tokens`: `continuous`, one loop of `--batch` slots that admits each request as slots
  free up (`stream`), and `before`, each batch a fixed loop to its longest row; each with its
  useful tokens/s (only tokens before each row's end) and idle slot fraction (`before` over the
  first `--before-batches` batches: each runs alone, so more only repeat it), beside the
  fixed-length figure of the same width (`graphs`). `--megatron-inference` also times
  `megatron_inference`: megatron-core's dynamic engine as `rollout.engine: megatron` builds it,
  over a megatron `GPTModel` with the same weights, on the same batch (tokens/s and its median
  step beside `graphs`', its logprobs against the recomputed ones), and its stand-down and wake
  (`bench/megatron_inference.py`). `--megatron-graphs on,off` times it with its CUDA graphs
  (`rollout.graphs`, the default here) and without (`megatron_inference_eager`: one call;
  megatron's recompute handoffs, also with megatron's own `suspend()`); `--megatron-variants`
  each schedule and sampler asked for (`megatron_inference_legacy_megatron`, ...);
  `--megatron-attention adapter,flash-attn-4` each `rollout.attention` (`..._fa4`: the
  flash-attn-4 package's kernels, which must be installed);
  `--megatron-profile` and `--megatron-trace STEPS` profile one more call of each.
- `handoff`: `release` (stand-down) and `wake` times of the sampler's KV cache, a check that
  the captured graphs still
  give the same greedy tokens afterwards, and the handoff check's cost: the trainer's and the
  engine's weight fingerprints (`backends/torch/fingerprint.py`), each timed alone.
- `train`: the model's training tokens/s and MFU at sequence length 1024: full sequences
  through the trainer's logprob head (`picked_logprobs`, not its prompt-sharing pass), bf16
  weights stepped directly by fused AdamW (no float32 masters), SDPA; `--train-modes`: eager
  layers, each layer torch.compile'd, the whole forward compiled, or `trainer`: the trainer's
  own prompt-sharing pass with `train.compile` (`response_logprobs(compiled=True)`), each
  sequence a one-token prompt and a 1023-token response (on CUDA the responses' attention is
  one variable-length flash call), or `megatron`: the megatron backend's training step
  (`backends/megatron`: GPTModel with SDPA core attention inside megatron's DDP, its
  distributed optimizer stepping bf16 weights through float32 masters, the trainer's
  `response_logprobs`), `megatron-compiled` the same with each layer compiled (`train.compile`).
  `--accumulate N`: N micro-batches' gradients summed into each optimizer update (a recipe's
  step of 256 samples in micro-batches of 16 is one update over 16), default 1.
  The trainer end to end is measured by the `recipes/bench-h200-*.yaml` runs.
  FLOPs per token = 6 * (non-embedding params + lm_head) + 12 * layers * hidden * seq.

    python -m bench.gpu [--parts generate,handoff,train] [--train-modes eager,model] [--out ...]
    python -m bench.gpu --parts generate --new-tokens 2048 --bench-lengths 256,0.9 --repeats 1
    python -m bench.gpu --parts generate --megatron-inference
    python -m bench.gpu --parts generate --megatron-inference --repeats 1 \
        --megatron-variants legacy+megatron,legacy+race,async+megatron,async+race,async+fused \
        --megatron-trace 16
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from backends.bench_lengths import LengthDraw
from backends.torch.config import ModelConfig
from backends.torch.fingerprint import Fingerprinter, parameter_probes
from backends.torch.grouped import response_logprobs
from backends.torch.logprobs import picked_logprobs
from backends.torch.model import Decoder, token_logprobs
from backends.torch.sampler import Admission, Sampler
from pipeline.algorithms.losses import mismatch_metrics
from pipeline.contracts.messages import Completion
from pipeline.contracts.sections import BenchLengths

QWEN_1_5B = ModelConfig(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    attention_bias=True,
)
PEAK_FLOPS = 790e12  # measured bf16 matmul rate of one H200 here (FACTS.md)


def _model(residual: str, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = Decoder(QWEN_1_5B)
    model = model.to(torch.bfloat16)
    if residual == "float32":  # as `model.residual: float32` in a recipe
        model.residual_dtype = torch.float32
    return model


def _sync_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def bench_generate(model: Decoder, args: argparse.Namespace) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, QWEN_1_5B.vocab_size, (args.batch, args.prompt_len), generator=g).tolist()
    out: dict[str, Any] = {
        "batch": args.batch,
        "prompt_tokens": args.prompt_len,
        "new_tokens": args.new_tokens,
        "distinct_prompts": args.batch,
    }
    variants = [("graphs", True, True)]
    if args.uncompiled:
        variants.append(("graphs_uncompiled", True, False))
    if args.eager:
        variants.append(("eager", False, False))
    for name, graphs, compiled in variants:
        sampler = Sampler(model, graphs=graphs, compiled=compiled)
        gen = torch.Generator("cuda").manual_seed(0)
        kw = dict(max_new_tokens=args.new_tokens, temperature=1.0, generator=gen)
        start = _sync_time()
        requests = [(p, 1) for p in prompts]
        sampler.generate(requests, **kw)  # first call: allocates the cache, compiles, captures
        first = _sync_time() - start
        times = []
        for _ in range(args.repeats if graphs else 1):
            start = _sync_time()
            outs = [c for (c,) in sampler.generate(requests, **kw)]
            times.append(_sync_time() - start)
        # Prefill and the first token only (drawn from the prefill), to split the call's time.
        start = _sync_time()
        sampler.generate(requests, max_new_tokens=1, temperature=1.0, generator=gen)
        prefill = _sync_time() - start
        tokens = sum(len(o.tokens) for o in outs)
        best = min(times)
        out[name] = {
            "first_call_s": first,
            "call_s": times,
            "tokens": tokens,
            "tokens_per_s": tokens / best,
            "prefill_s": prefill,
            "ms_per_decode_step": 1000 * (best - prefill) / (args.new_tokens - 1),
            "pool_bytes": sampler.cache_bytes(),  # the KV cache
        }
        print(name, json.dumps(out[name]), flush=True)
        if graphs:
            out[name]["mismatch"] = _mismatch(model, prompts, outs)
            print("mismatch", json.dumps(out[name]["mismatch"]), flush=True)
        sampler.cache.pool.free()
        del sampler
        torch.cuda.empty_cache()
    if args.megatron_inference:
        out |= _megatron_variants(model, prompts, args, ours=out["graphs"])
    if args.bench_lengths:
        out["long_tail"] = tail = _long_tail(model, args)
        fixed = out["graphs"]["tokens_per_s"]  # the fixed-length figure at the same width
        tail["fixed_length_tokens_per_s"] = fixed
        tail["continuous_over_fixed_length"] = tail["continuous"]["tokens_per_s"] / fixed
        tail["continuous_over_before"] = tail["continuous"]["tokens_per_s"] / tail["before"]["tokens_per_s"]
    return out


def _megatron_variants(
    model: Decoder, prompts: list[list[int]], args: argparse.Namespace, *, ours: dict[str, Any]
) -> dict[str, Any]:
    """Each `--megatron-graphs` x `--megatron-variants` run of megatron's engine
    (`bench/megatron_inference.py`), beside our engine's `graphs` figures. A variant that fails
    is kept as its error (its traceback printed), and the next one runs."""
    import traceback

    from bench import megatron_inference

    out: dict[str, Any] = {}
    runs = [
        (g, v, a)
        for g in args.megatron_graphs
        for v in args.megatron_variants
        for a in args.megatron_attention
    ]
    for graphs, text, attention in runs:
        serving = megatron_inference.variant(text)
        name = megatron_inference.name(serving, graphs=graphs, attention=attention)
        try:
            result = megatron_inference.run(
                model,
                QWEN_1_5B,
                prompts,
                args,
                graphs=graphs,
                serving=serving,
                mismatch=lambda outs: _mismatch(model, prompts, outs),
                attention=attention,
            )
        except Exception as error:  # a bench of variants: the others still run
            traceback.print_exc()
            out[name] = {"error": repr(error)}
            torch.cuda.empty_cache()
            continue
        result["over_graphs"] = result["tokens_per_s"] / ours["tokens_per_s"]
        result["step_ms_over_graphs"] = result["step_ms_median"] / ours["ms_per_decode_step"]
        out[name] = result
    return out


def _long_tail(model: Decoder, args: argparse.Namespace) -> dict[str, Any]:
    """`--stream-batches` batches of `--batch` rows, as (prompt, `--samples-per-prompt`)
    requests with lengths drawn as `rollout.bench_lengths` draws them, through one continuous
    loop of `--batch` slots, and "before": each batch as one fixed loop to its longest row."""
    median, sigma = args.bench_lengths
    lengths = BenchLengths(median_tokens=median, sigma=sigma)
    group = args.samples_per_prompt
    count = args.stream_batches * args.batch // group
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(3, QWEN_1_5B.vocab_size, (count, args.prompt_len), generator=g).tolist()
    draw = LengthDraw(lengths, max_new_tokens=args.new_tokens, seed=0)
    requests = [Admission(p, draw.draw(group), i) for i, p in enumerate(prompts)]
    ordered = sorted(n for r in requests for n in r.limits)
    out: dict[str, Any] = {
        "bench_lengths": lengths.describe(args.new_tokens),
        "requests": count,
        "samples_per_prompt": group,
        "slots": args.batch,
        "lengths_p50": ordered[len(ordered) // 2],
        "lengths_p90": ordered[int(0.9 * (len(ordered) - 1))],
        "lengths_max": ordered[-1],
        "lengths_mean": sum(ordered) / len(ordered),
    }
    sampler = Sampler(model)  # a fresh one: its cache and graphs sized for this width
    kw = dict(max_new_tokens=args.new_tokens, temperature=1.0, generator=torch.Generator("cuda"))
    # Allocates the cache, compiles and captures (the same width and length), in 2 steps.
    warm = [Admission(r.prompt, [2] * group) for r in requests[: args.batch // group]]
    stream(sampler, warm, args.batch, continuous=False, **kw)
    # Each fixed batch runs alone to its longest row: its first --before-batches time it.
    before = requests[: min(args.before_batches, args.stream_batches) * args.batch // group]
    for name, continuous, given in (("continuous", True, requests), ("before", False, before)):
        runs = [
            stream(sampler, given, args.batch, continuous=continuous, sync=torch.cuda.synchronize, **kw)
            for _ in range(args.repeats)
        ]
        best = min(runs, key=lambda run: run["s"])
        out[name] = {**best, "call_s": [run["s"] for run in runs], "tokens_per_s": best["tokens"] / best["s"]}
        print("long_tail", name, json.dumps(out[name]), flush=True)
    sampler.cache.pool.free()
    del sampler
    torch.cuda.empty_cache()
    return out


def stream(
    sampler: Sampler,
    requests: list[Admission],
    slots: int,
    *,
    continuous: bool,
    sync: Callable[[], None] = lambda: None,
    **kw: Any,
) -> dict[str, Any]:
    """Generate ``requests`` in order (each row to its limit, no stop tokens) with at most
    ``slots`` rows at once. ``continuous``: one `Sampler.serve` loop, each request admitted as
    soon as its rows fit the free slots (another loop only if one did not fit the cache);
    otherwise (today's fixed batches) one loop per ``slots`` rows, nothing admitted mid-loop.
    Returns seconds ``s`` (``drain_s`` of them after the last admission), ``tokens``, ``loops``
    and ``idle_slot_fraction``."""
    waiting = list(requests)
    done: list[Completion] = []
    loops = 0
    before = sampler.slot_steps
    admitted = [0.0]  # when the last request was admitted (at a check: the host is in step)

    def source(rows: int | None, positions: int | None) -> list[Admission]:
        given: list[Admission] = []
        free = slots if rows is None else rows
        while waiting and len(waiting[0].limits) <= free and (rows is None or continuous):
            if positions is not None and len(waiting[0].prompt) + max(waiting[0].limits) > positions:
                break
            given.append(waiting.pop(0))
            free -= len(given[-1].limits)
        if given and not waiting:
            admitted[0] = time.perf_counter()
        return given

    sync()
    start = time.perf_counter()
    while waiting:
        loops += 1
        sampler.serve(source, lambda back: done.extend(c for _, out in back for c in out), **kw)
    sync()
    seconds = time.perf_counter() - start
    tokens = sum(len(c.tokens) for c in done)
    assert tokens == sum(sum(r.limits) for r in requests), "every row ends at its limit"
    return {
        "s": seconds,
        # From the last admission to the end: the slots drain, and nothing refills them.
        "drain_s": start + seconds - admitted[0],
        "tokens": tokens,
        "loops": loops,
        "idle_slot_fraction": 1 - tokens / (sampler.slot_steps - before),
    }


@torch.no_grad()
def _mismatch(model: Decoder, prompts: list[list[int]], outs: list) -> dict[str, float]:
    rows = []
    for i in range(0, len(prompts), 32):
        seqs = [p + list(o.tokens) for p, o in zip(prompts[i : i + 32], outs[i : i + 32], strict=True)]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device="cuda")
        real = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device="cuda")
        lp = token_logprobs(model, ids, real)
        gen = torch.zeros_like(lp)
        mask = torch.zeros_like(lp)
        for j, (p, o) in enumerate(zip(prompts[i : i + 32], outs[i : i + 32], strict=True)):
            gen[j, len(p) - 1 : len(p) - 1 + len(o.tokens)] = torch.tensor(o.logprobs, device="cuda")
            mask[j, len(p) - 1 : len(p) - 1 + len(o.tokens)] = 1.0
        rows.append((lp, gen, mask))
    lp, gen, mask = (torch.cat([r[k] for r in rows]) for k in range(3))
    metrics = mismatch_metrics(lp, gen, mask)
    metrics["max_abs_logprob_diff"] = float(((lp - gen).abs() * mask).max())
    return metrics


def bench_handoff(model: Decoder, args: argparse.Namespace) -> dict[str, Any]:
    g = torch.Generator().manual_seed(2)
    prompts = torch.randint(3, QWEN_1_5B.vocab_size, (args.batch, args.prompt_len), generator=g).tolist()
    sampler = Sampler(model)
    kw = dict(max_new_tokens=64, temperature=0.0, generator=torch.Generator("cuda"))
    # Size the cache as the full benchmark does (prompt + new tokens), then check with short runs.
    full = dict(max_new_tokens=args.new_tokens, temperature=0.0, generator=torch.Generator("cuda"))
    requests = [(p, 1) for p in prompts]
    sampler.generate(requests, **full)
    before = sampler.generate(requests, **kw)
    stand_down, wake = [], []
    for _ in range(args.repeats + 2):
        start = _sync_time()
        sampler.release()
        stand_down.append(_sync_time() - start)
        start = _sync_time()
        sampler.wake()
        wake.append(_sync_time() - start)
    after = sampler.generate(requests, **kw)
    published = Fingerprinter(parameter_probes(model.named_parameters()))
    served = Fingerprinter(parameter_probes(sampler.model.named_parameters()))
    trainer_ms, engine_ms = [], []
    for _ in range(args.repeats + 2):
        start = _sync_time()
        expected = published()
        trainer_ms.append(1000 * (_sync_time() - start))
        start = _sync_time()
        got = served()
        engine_ms.append(1000 * (_sync_time() - start))
    result = {
        "pool_bytes": sampler.cache_bytes(),  # the KV cache
        "stable_addresses": sampler.cache.pool.stable,
        "stand_down_ms": [1000 * t for t in stand_down],
        "wake_ms": [1000 * t for t in wake],
        "stand_down_plus_wake_ms_median": 1000
        * sorted(a + b for a, b in zip(stand_down, wake, strict=True))[len(wake) // 2],
        "graphs_captured": sampler.captures,
        "greedy_tokens_equal_after_wake": [[o.tokens for o in g] for g in after]
        == [[o.tokens for o in g] for g in before],
        "fingerprint_tensors": len(expected),
        "fingerprint_samples": sum(p.indices.numel() for p in served.probes),
        "fingerprint_trainer_ms": trainer_ms,
        "fingerprint_engine_ms": engine_ms,
        "fingerprints_equal": expected == got,
    }
    print("handoff", json.dumps(result), flush=True)
    sampler.cache.pool.free()
    return result


def _flops_per_token(config: ModelConfig, seq: int) -> float:
    h, layers = config.hidden_size, config.num_hidden_layers
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size
    dense = layers * per_layer + h * config.vocab_size
    return 6 * dense + 12 * layers * q * seq


def _megatron_step(args: argparse.Namespace, *, compiled: bool) -> Any:
    """The megatron trainer's forward, loss and optimizer step on full sequences (``compiled``:
    each layer torch.compile'd, as `train.compile` does)."""
    from backends.megatron import parallel
    from backends.megatron.model import build_gpt_model, compile_layers
    from backends.megatron.optimizer import MegatronAdam
    from backends.megatron.trainer import response_logprobs

    device = torch.device("cuda")
    parallel.initialise(device=device)
    torch.manual_seed(0)
    model = build_gpt_model(QWEN_1_5B, dtype=torch.bfloat16, device=device)
    if compiled:
        compile_layers(model)
    optimizer = MegatronAdam(model, lr=1e-5, betas=(0.9, 0.999), weight_decay=0.0, grad_clip=1.0)
    ids = torch.randint(3, QWEN_1_5B.vocab_size, (args.micro_batch, args.seq), device=device)
    index = torch.arange(args.seq - 1, device=device).expand(args.micro_batch, -1)
    mask = torch.ones(index.shape, device=device)

    def step() -> None:
        for _ in range(args.accumulate):
            loss = -response_logprobs(optimizer.model, ids, index, mask, 1.0).mean()
            loss.backward()
        optimizer.step(1e-5)

    return step


def _train_variant(mode: str, args: argparse.Namespace) -> dict[str, float]:
    """One training setup: ``eager`` layers; ``layers``: each decoder layer torch.compile'd;
    ``model``: the whole forward to the final norm (`Decoder.hidden_states`) compiled;
    ``trainer``: `response_logprobs` with compiled layer parts. The logprob head
    (`picked_logprobs`) is the trainer's in all (its per-chunk float32 work fused on CUDA)."""
    if mode.startswith("megatron"):
        return _timed_steps(_megatron_step(args, compiled=mode == "megatron-compiled"), args)
    model = _model(args.residual)
    model.train()
    hidden_states = model.hidden_states
    if mode == "layers":
        for layer in model.model.layers:
            layer.compile()
    elif mode == "model":
        hidden_states = torch.compile(hidden_states, fullgraph=True, dynamic=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(3, QWEN_1_5B.vocab_size, (args.micro_batch, args.seq), device="cuda")
    positions = torch.arange(args.seq - 1, device="cuda").expand(args.micro_batch, -1)
    rows = ids.tolist()
    prompts, responses = [tuple(r[:1]) for r in rows], [tuple(r[1:]) for r in rows]

    def step() -> None:
        for _ in range(args.accumulate):
            if mode == "trainer":
                owner = list(range(len(prompts)))
                lp, _ = response_logprobs(model, prompts, owner, responses, 1.0, compiled=True)
                loss = -lp.mean()
            else:  # token_logprobs(model, ids, mask) for sequences without padding
                hidden = hidden_states(ids[:, :-1], positions)
                loss = -picked_logprobs(hidden, model.lm_head.weight, ids[:, 1:]).mean()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _timed_steps(step, args)


def _timed_steps(step: Any, args: argparse.Namespace) -> dict[str, float]:
    torch.cuda.reset_peak_memory_stats()
    start = _sync_time()
    for _ in range(3):
        step()
    warm = _sync_time() - start
    start = _sync_time()
    for _ in range(args.train_steps):
        step()
    elapsed = _sync_time() - start
    tokens_per_s = args.train_steps * args.accumulate * args.micro_batch * args.seq / elapsed
    flops = _flops_per_token(QWEN_1_5B, args.seq)
    return {
        "warmup_s": warm,
        "step_s": elapsed / args.train_steps,
        "tokens_per_s": tokens_per_s,
        "tflops": tokens_per_s * flops / 1e12,
        "mfu": tokens_per_s * flops / PEAK_FLOPS,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def bench_train(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "seq": args.seq,
        "micro_batch": args.micro_batch,
        "accumulate": args.accumulate,
        "flops_per_token": _flops_per_token(QWEN_1_5B, args.seq),
    }
    for name in args.train_modes.split(","):
        if name not in ("eager", "layers", "model", "trainer", "megatron", "megatron-compiled"):
            raise SystemExit(
                f"--train-modes: unknown mode {name!r} "
                "(eager, layers, model, trainer, megatron, megatron-compiled)"
            )
        result[name] = _train_variant(name, args)
        print("train", name, json.dumps(result[name]), flush=True)
        torch.cuda.empty_cache()
    return result


def _megatron_variant(text: str) -> str:
    schedule, _, sampler = text.partition("+")
    if schedule not in ("async", "legacy") or sampler not in ("race", "fused", "megatron"):
        raise argparse.ArgumentTypeError(
            f"give SCHEDULE+SAMPLER, SCHEDULE async or legacy, SAMPLER race, fused or megatron; got {text!r}"
        )
    return text


def _median_sigma(text: str) -> tuple[int, float]:
    try:
        median, sigma = text.split(",")
        value = int(median), float(sigma)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give MEDIAN,SIGMA (e.g. 256,0.9), got {text!r}") from None
    if value[0] < 1 or value[1] <= 0:
        raise argparse.ArgumentTypeError(f"MEDIAN must be >= 1 and SIGMA > 0, got {text!r}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="generate,handoff,train")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512, help="at least 2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eager", action="store_true", help="also time the sampler without graphs")
    parser.add_argument(
        "--uncompiled", action="store_true", help="also time graphs of uncompiled decode steps"
    )
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--train-steps", type=int, default=10)
    parser.add_argument(
        "--accumulate",
        type=int,
        default=1,
        help="train: micro-batches whose gradients one optimizer update sums (a recipe's step "
        "of 256 samples in micro-batches of 16 makes 16)",
    )
    parser.add_argument(
        "--train-modes",
        default="eager,model",
        help="comma list of eager, layers (each layer compiled), model (forward compiled), "
        "trainer (the trainer's pass with train.compile), megatron (the megatron backend's step), "
        "megatron-compiled (its layers compiled)",
    )
    parser.add_argument(
        "--megatron-inference",
        action="store_true",
        help="generate: also time megatron's dynamic engine (rollout.engine megatron) on the same batch",
    )
    parser.add_argument(
        "--megatron-graphs",
        type=lambda text: [{"on": True, "off": False}[v] for v in text.split(",")],
        default=[True],
        help="with --megatron-inference: comma list of on (rollout.graphs: true; the default here) and off",
    )
    parser.add_argument(
        "--megatron-variants",
        type=lambda text: [_megatron_variant(v) for v in text.split(",")],
        default=["async+race"],
        help="with --megatron-inference: comma list of SCHEDULE+SAMPLER, SCHEDULE async (the "
        "pipeline's) or legacy, SAMPLER race (the pipeline's), fused or megatron; each one built and timed",
    )
    parser.add_argument(
        "--megatron-attention",
        type=lambda text: text.split(","),
        default=["adapter"],
        help="with --megatron-inference: comma list of adapter (rollout.attention's default: torch's "
        "flash kernels and our Triton paged decode) and flash-attn-4 (that package's kernels, installed)",
    )
    parser.add_argument(
        "--megatron-profile",
        action="store_true",
        help="with --megatron-inference: one more call with the engine's steps under cProfile",
    )
    parser.add_argument(
        "--megatron-trace",
        type=int,
        default=0,
        metavar="STEPS",
        help="with --megatron-inference: one more call with STEPS decode steps under torch.profiler "
        "(per step: wall, GPU busy and idle, host blocked in syncs; the trace beside --out)",
    )
    parser.add_argument("--residual", choices=["model", "float32"], default="model")
    parser.add_argument(
        "--bench-lengths",
        type=_median_sigma,
        help="MEDIAN,SIGMA: also time the generate part with lognormal response lengths",
    )
    parser.add_argument(
        "--stream-batches", type=int, default=4, help="long_tail: batches of --batch rows streamed"
    )
    parser.add_argument(
        "--before-batches", type=int, default=4, help="long_tail: of those, timed as fixed batches"
    )
    parser.add_argument("--samples-per-prompt", type=int, default=8, help="long_tail: rows per request")
    parser.add_argument("--out", default="bench/results-h200.json")
    args = parser.parse_args()
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (decode steps are timed apart from the prefill)")
    if args.batch % args.samples_per_prompt:
        parser.error("--samples-per-prompt must divide --batch (long_tail's requests fill its slots)")
    parts = args.parts.split(",")
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": "Qwen2.5-1.5B shape, random init, bf16",
        "residual": args.residual,
    }
    path = Path(args.out)

    def save() -> None:
        path.write_text(json.dumps(results, indent=2) + "\n")

    if "generate" in parts or "handoff" in parts:
        model = _model(args.residual)
        if "generate" in parts:
            results["generate"] = bench_generate(model, args)
            save()
        if "handoff" in parts:
            results["handoff"] = bench_handoff(model, args)
            save()
        del model
        torch.cuda.empty_cache()
    if "train" in parts:
        results["train"] = bench_train(args)
        save()


if __name__ == "__main__":
    main()
