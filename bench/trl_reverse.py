"""Hugging Face TRL baseline: seconds per GRPO optimizer step on the reverse-digits task, on CPU.

The same task and model size as `recipes/reverse-digits.yaml`, run with TRL's `GRPOTrainer`:
a 2-layer, width-128 Llama from random weights over a 14-token character vocabulary, prompts
"12345=" -> "54321", 32 prompts x 8 samples = 256 completions per optimizer step, beta 0, no vLLM.
Each step's wall time is taken at `on_step_end`; steps 1-5 are dropped and the median is written
to bench/results-trl.json (not kept in the repo: `python -m bench.cpu --trl PYTHON` runs this
side by side with ours and records both in bench/results-cpu.json). TRL lives in its own
virtualenv, apart from the project's:

    python3 -m venv /tmp/trlvenv
    /tmp/trlvenv/bin/pip install torch==2.13.0 && /tmp/trlvenv/bin/pip install 'trl==1.16.*'
    /tmp/trlvenv/bin/python bench/trl_reverse.py [--steps 40] [--max-completion-length 5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

import torch
import transformers
import trl
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

SPECIALS = ["<pad>", "<bos>", "<eos>"]
VOCAB = {tok: i for i, tok in enumerate([*SPECIALS, *"0123456789="])}


def make_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; "<bos>" is prepended to every encoded text."""
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", VOCAB["<bos>"])]
    )
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        padding_side="left",
    )


def make_dataset(n: int, seed: int) -> Dataset:
    rng = random.Random(seed)
    digits = ["".join(rng.choice("0123456789") for _ in range(5)) for _ in range(n)]
    return Dataset.from_dict({"prompt": [d + "=" for d in digits], "answer": [d[::-1] for d in digits]})


def positional_reward(completions: list[str], answer: list[str], **_) -> list[float]:
    """Digit positions where the completion matches the answer, over the longer of the two."""
    rewards = []
    for text, ans in zip(completions, answer, strict=True):
        text = text.strip()
        hits = sum(a == b for a, b in zip(text, ans, strict=False))
        rewards.append(hits / max(len(ans), len(text)))
    return rewards


class StepTimer(TrainerCallback):
    def __init__(self) -> None:
        self.times = [time.perf_counter()]

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="leading steps left out of the median")
    parser.add_argument("--max-completion-length", type=int, default=5)
    parser.add_argument("--out", default="bench/results-trl.json")
    args = parser.parse_args()

    torch.set_num_threads(2)
    torch.manual_seed(0)
    tokenizer = make_tokenizer()
    model_config = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(model_config)

    prompts_per_step, samples = 32, 8
    config = dict(
        learning_rate=3e-4,
        per_device_train_batch_size=prompts_per_step * samples,  # counted in completions
        gradient_accumulation_steps=1,
        num_generations=samples,
        max_completion_length=args.max_completion_length,
        temperature=1.0,
        beta=0.0,
        use_vllm=False,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=0,
    )
    with tempfile.TemporaryDirectory() as tmp:
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=positional_reward,
            args=GRPOConfig(output_dir=tmp, **config),
            train_dataset=make_dataset(prompts_per_step * args.steps, seed=0),
            processing_class=tokenizer,
        )
        timer = StepTimer()
        trainer.add_callback(timer)
        timer.times = [time.perf_counter()]
        trainer.train()

    step_s = [b - a for a, b in zip(timer.times, timer.times[1:], strict=False)]
    rewards = [r["reward"] for r in trainer.state.log_history if "reward" in r]
    result = {
        "trl_version": trl.__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "step_s_median": statistics.median(step_s[args.warmup :]),
        "steps": len(step_s),
        "steps_in_median": len(step_s[args.warmup :]),
        "step_s": [round(s, 4) for s in step_s],
        "reward_first_last": [rewards[0], rewards[-1]] if rewards else None,
        "config": {
            **config,
            "prompts_per_step": prompts_per_step,
            "torch_threads": torch.get_num_threads(),
            "model": {
                k: getattr(model_config, k)
                for k in (
                    "vocab_size",
                    "hidden_size",
                    "intermediate_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "max_position_embeddings",
                )
            },
            "cpu_count": os.cpu_count(),
        },
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
