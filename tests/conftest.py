"""Shared fixtures: every async test runs on the stdlib loop and on uvloop; GPU tests skip without CUDA."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import uvloop

from backends.torch.runtime import load

# torch comes up here as a run brings it up (OpenMP's threads spin briefly, then sleep), before
# any test module imports it: with the default spinning, the in-process runs' two threads were
# many times slower on a machine loaded by other work.
load()

# Ray's own start-up waits (for its GCS port, a worker's and an agent's registration) are sized
# for an idle machine; on a loaded shared one (CI) its Python processes import many times slower
# and a wait that runs out fails the test. Every Ray runtime the tests start (the session's
# cluster, a run's own, a command line's in a subprocess) reads these from its environment: a
# bound that catches a hang, not a slow start.
RAY_START_UP_S = 600
for _name, _value in [
    ("RAY_gcs_server_port_wait_time_s", RAY_START_UP_S),
    ("RAY_worker_register_timeout_seconds", RAY_START_UP_S),
    ("RAY_agent_register_timeout_ms", RAY_START_UP_S * 1000),
]:
    os.environ.setdefault(_name, str(_value))


def pytest_asyncio_loop_factories(config, item):
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip)


# A tiny Qwen2 checkpoint with its own byte-level BPE tokenizer and a Qwen-style chat template,
# written the way a Hugging Face model directory is (built here: nothing is downloaded).
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TINY_CORPUS = [
    "What is 3 + 4? The answer is \\boxed{7}.",
    "Natalia sold 48 clips in April and half as many in May. How many clips in all? 72",
    "Compute 12 * 3 - 5 = 31. So the final answer is \\boxed{31}.",
    "Please reason step by step, and put your final answer within \\boxed{}.",
]
TINY_MODEL_VOCAB = 320  # larger than the tokenizer's, as real checkpoints pad theirs


def write_tiny_tokenizer(directory):
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TINY_CORPUS, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    eos = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """A Hugging Face directory: a random 2-layer Qwen2 (saved by transformers) and a tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    directory = tmp_path_factory.mktemp("tiny-qwen2")
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=TINY_MODEL_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(config).save_pretrained(directory)
    write_tiny_tokenizer(directory)
    return directory


MATH_ROWS = [
    {"prompt": "What is 3 + 4?", "answer": "7"},
    {"prompt": "Compute 12 * 3 - 5.", "answer": "31"},
    {"prompt": "Natalia sold 48 clips in April and half as many in May. How many in all?", "answer": "72"},
    {"prompt": "What is half of 1?", "answer": "\\frac{1}{2}"},
]


@pytest.fixture(scope="session")
def tiny_qwen2_run(tiny_qwen2_dir, tmp_path_factory):
    """A finished 3-step GRPO run from `tiny_qwen2_dir` (chat template, JSONL, math reward):
    (recipe, its run dir)."""
    import json

    import anyio

    import pipeline

    root = tmp_path_factory.mktemp("tiny-qwen2-run")
    data = root / "math.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in MATH_ROWS))
    recipe = pipeline.load_recipe(
        Path(__file__).parent / "data" / "tiny-hf.yaml",
        [f"run.dir={root / 'run'}", f"model.path={tiny_qwen2_dir}", f"prompts.source.path={data}"],
    )
    anyio.run(pipeline.run, recipe)
    return recipe, root / "run"
