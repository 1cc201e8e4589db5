"""One completion for one prompt from a checkpoint or a Hugging Face directory (`generate`).

The same sampler the pipeline's engine runs (`backends.torch.sampler.Sampler`), stopping at the
tokenizer's stop ids; temperature 0 is greedy. The prompt is text as the run's prompts were
written (the digit tasks: the digits and `=`, e.g. `12349=`). It imports torch: the CLI
imports it lazily.
"""

from __future__ import annotations

import logging

import msgspec
import torch

from backends.torch.sampler import Sampler
from pipeline.contracts.errors import RecipeError
from pipeline.shell.model_files import OpenedModel
from stages.tokenizer import ChatTokenizer

log = logging.getLogger("pipeline.shell.generate")


class Generation(msgspec.Struct, frozen=True, kw_only=True):
    text: str
    prompt_tokens: list[int]
    tokens: list[int]
    logprobs: list[float]  # each generated token's logprob under the sampling distribution
    finish_reason: str


DEFAULT_MAX_NEW_TOKENS = 128


def check_sampling(max_new_tokens: int | None, temperature: float, top_p: float) -> None:
    """`RecipeError` naming the flag for sampling arguments the sampler would refuse."""
    if max_new_tokens is not None and max_new_tokens < 1:
        raise RecipeError(f"--max-new-tokens: must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise RecipeError(f"--temperature: must be >= 0 (0 is greedy), got {temperature:g}")
    if not 0 < top_p <= 1:
        raise RecipeError(f"--top-p: must be in (0, 1] (1 keeps every token), got {top_p:g}")


def generate(
    opened: OpenedModel,
    prompt: str,
    *,
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    chat: bool = False,
    system: str | None = None,
    seed: int = 0,
) -> Generation:
    """`max_new_tokens` None: what the model was trained to generate (its run's
    `rollout.max_new_tokens`, or `max_new_tokens` in generation_config.json), else 128; cut to
    what fits a learned position table."""
    tokenizer = opened.tokenizer
    if tokenizer is None:
        raise RecipeError(f"{opened.hf_dir}: no tokenizer.json, so the prompt cannot be tokenized")
    if chat:
        if not isinstance(tokenizer, ChatTokenizer):
            raise RecipeError("--chat: this model has a character tokenizer, which has no chat template")
        ids = tokenizer.encode_chat(prompt, system=system)
    else:
        ids = tokenizer.encode(prompt, where="--prompt")
    if not ids:
        raise RecipeError("--prompt: the prompt is empty after tokenization")
    new_tokens = _new_tokens(opened, len(ids), max_new_tokens)
    sampler = Sampler(opened.model, graphs=False)  # one call: nothing to capture or compile
    generator = torch.Generator(device=sampler.device).manual_seed(seed)
    ((completion,),) = sampler.generate(
        [(ids, 1)],
        max_new_tokens=new_tokens,
        temperature=temperature,
        top_p=top_p,
        stop_token_ids=tokenizer.stop_ids,
        generator=generator,
    )
    if completion.finish_reason == "length":
        log.info("stopped after %d new tokens without an end-of-sequence token", new_tokens)
    return Generation(
        text=tokenizer.decode(completion.tokens),
        prompt_tokens=list(ids),
        tokens=list(completion.tokens),
        logprobs=list(completion.logprobs),
        finish_reason=completion.finish_reason,
    )


def _new_tokens(opened: OpenedModel, prompt_tokens: int, asked: int | None) -> int:
    limit = opened.config.position_limit
    room = None if limit is None else limit - prompt_tokens
    if room is not None and room < 1:
        raise RecipeError(
            f"--prompt: its {prompt_tokens} tokens fill the model's {limit} positions "
            "(learned position embeddings); give a shorter prompt"
        )
    if asked is None:
        default = opened.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        return default if room is None else min(default, room)
    if room is not None and asked > room:
        raise RecipeError(
            f"--max-new-tokens: {asked} new tokens after a prompt of {prompt_tokens} exceed the model's "
            f"{limit} positions (learned position embeddings); give at most {room}"
        )
    return asked
