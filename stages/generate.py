"""One completion for one prompt from a checkpoint or a Hugging Face directory (`generate`).

The same sampler the pipeline's engine runs (`backends.torch.engine.Sampler`), stopping at the
tokenizer's stop ids; temperature 0 is greedy. It imports torch: the CLI imports it lazily.
"""

from __future__ import annotations

import msgspec
import torch

from backends.torch.engine import Sampler
from pipeline.errors import RecipeError
from stages.model_files import OpenedModel


class Generation(msgspec.Struct, frozen=True, kw_only=True):
    text: str
    prompt_tokens: list[int]
    tokens: list[int]
    logprobs: list[float]  # each generated token's logprob under the sampling distribution
    finish_reason: str


def generate(
    opened: OpenedModel,
    prompt: str,
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    chat: bool = False,
    system: str | None = None,
    seed: int = 0,
) -> Generation:
    tokenizer = opened.tokenizer
    if tokenizer is None:
        raise RecipeError(f"{opened.hf_dir}: no tokenizer.json, so the prompt cannot be tokenized")
    if chat:
        encode_chat = getattr(tokenizer, "encode_chat", None)
        if encode_chat is None:
            raise RecipeError("--chat: this model has a character tokenizer, which has no chat template")
        ids = encode_chat(prompt, system=system)
    else:
        ids = tokenizer.encode(prompt, where="--prompt")
    if not ids:
        raise RecipeError("--prompt: the prompt is empty after tokenization")
    sampler = Sampler(opened.model)
    generator = torch.Generator(device=sampler.device).manual_seed(seed)
    (completion,) = sampler.generate(
        [ids],
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        stop_token_ids=tokenizer.stop_ids,
        generator=generator,
    )
    return Generation(
        text=tokenizer.decode(completion.tokens),
        prompt_tokens=list(ids),
        tokens=list(completion.tokens),
        logprobs=list(completion.logprobs),
        finish_reason=completion.finish_reason,
    )
