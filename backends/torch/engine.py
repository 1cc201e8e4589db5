"""Synchronous batched sampler over a `Decoder` with a preallocated KV cache.

Each `Completion`'s ``logprobs[i]`` is log_softmax(logits / temperature)[tokens[i]] before top-p
truncation (temperature 1 when sampling greedily); a stop token, when hit, is the last token.
"""

import copy
from collections.abc import Sequence

import torch
from torch import Tensor

from backends.torch.model import Decoder, KVCache
from backends.torch.sampling import check_arguments, completions, draw
from pipeline.messages import Completion


class Sampler:
    """Generates completions for batches of token-id prompts.

    The sampler reads the weights of ``model`` at every call, so in-place weight updates
    are picked up. If ``device``/``dtype`` differ from the model's, it samples from a private
    converted copy instead (update ``sampler.model`` then). The KV cache grows to the largest
    batch and length seen and is reused until `release`.
    """

    def __init__(
        self,
        model: Decoder,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        param = next(model.parameters())
        # Resolving through a tensor turns "cuda" into "cuda:0" so the comparison is exact.
        self.device = param.device if device is None else torch.empty(0, device=device).device
        self.dtype = param.dtype if dtype is None else dtype
        if (param.device, param.dtype) != (self.device, self.dtype):
            model = copy.deepcopy(model).to(device=self.device, dtype=self.dtype)
        self.model = model
        self._cache: KVCache | None = None
        self._key_mask: Tensor | None = None

    def release(self) -> None:
        """Free the KV cache; the next `generate` allocates a new one."""
        self._cache = None
        self._key_mask = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        """Nothing to map back: the next `generate` allocates the cache it needs."""

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] = (),
        generator: torch.Generator,
    ) -> list[Completion]:
        """Sample up to ``max_new_tokens`` tokens after each prompt, one Completion per prompt.

        ``temperature`` 0 means greedy (``top_p`` then unused). All randomness comes from
        ``generator`` (on the sampler's device): equal generator state and inputs give
        bit-identical outputs. Prompts may differ in length; they are left-padded internally.
        """
        check_arguments(
            prompts, max_new_tokens, temperature, top_p, max_positions=self.model.config.position_limit
        )
        if not prompts:
            return []
        lengths = [len(p) for p in prompts]

        batch, width = len(prompts), max(lengths)
        cache, key_mask = self._buffers(batch, width + max_new_tokens)
        dev = self.device
        # GRPO repeats each prompt for its group: prefill every distinct prompt once and copy
        # its keys/values to the rows that share it.
        unique_index: dict[tuple[int, ...], int] = {}
        row_to_unique = [unique_index.setdefault(tuple(p), len(unique_index)) for p in prompts]
        unique = list(unique_index)
        input_ids = torch.tensor(
            [[0] * (width - len(p)) + list(p) for p in unique], dtype=torch.long, device=dev
        )
        columns = torch.arange(width, device=dev)
        pad = width - torch.tensor([len(p) for p in unique], device=dev).unsqueeze(1)
        real = columns >= pad
        # Real tokens get positions 0..len-1 whatever their padding; padding gets 0.
        position_ids = (columns - pad).clamp_(min=0)
        # Without padding every key is real, and SDPA runs faster with no mask at all.
        padded = min(lengths) < width
        prefill_mask = real if padded else None
        prefill = self.model.hidden_states(input_ids, position_ids, prefill_mask, cache.rows(len(unique)))
        hidden = prefill[:, -1]
        if len(unique) < batch:
            gather = torch.tensor(row_to_unique, device=dev)
            hidden, real = hidden[gather], real[gather]
            for buf in (*cache.keys, *cache.values):
                buf[:, :, :width] = buf[: len(unique), :, :width][gather]
        key_mask[:, :width] = real
        key_mask[:, width:] = True
        next_position = torch.tensor(lengths, dtype=torch.long, device=dev).unsqueeze(1)

        stop = torch.tensor(list(stop_token_ids), dtype=torch.long, device=dev)
        tokens = torch.empty(batch, max_new_tokens, dtype=torch.long, device=dev)
        logprobs = torch.empty(batch, max_new_tokens, dtype=torch.float32, device=dev)
        generated = torch.zeros(batch, dtype=torch.long, device=dev)
        done = torch.zeros(batch, dtype=torch.bool, device=dev)

        step = 0
        while True:
            logits = self.model.lm_head(hidden).float()
            token, logprob = draw(logits, temperature, top_p, generator)
            tokens[:, step] = token
            logprobs[:, step] = logprob
            generated += ~done
            if stop.numel():
                done |= torch.isin(token, stop)
            step += 1
            # Finished rows keep riding along (their outputs are ignored) so shapes stay fixed.
            if step == max_new_tokens or (stop.numel() and bool(done.all())):
                break
            start = width + step - 1
            step_mask = key_mask[:, : start + 1] if padded else None
            hidden = self.model.hidden_states(token.unsqueeze(1), next_position, step_mask, cache, start)[
                :, -1
            ]
            next_position += 1

        return completions(generated, tokens[:, :step], logprobs[:, :step], stop_token_ids)

    def cache_bytes(self) -> int:
        """Bytes held by the KV cache (0 after `release`)."""
        if self._cache is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self._cache.keys + self._cache.values)

    def _buffers(self, batch: int, length: int) -> tuple[KVCache, Tensor]:
        """Cache and key mask views of exactly ``batch`` rows, at least ``length`` positions."""
        cache = self._cache
        if cache is None or cache.batch < batch or cache.length < length:
            rows, positions = batch, length
            if cache is not None:
                rows, positions = max(rows, cache.batch), max(positions, cache.length)
            # Drop the old buffers first so peak memory is one cache, not two.
            self.release()
            self._cache = KVCache.allocate(
                self.model.config, rows, positions, dtype=self.dtype, device=self.device
            )
            self._key_mask = torch.empty(rows, positions, dtype=torch.bool, device=self.device)
        assert self._cache is not None and self._key_mask is not None
        return self._cache.rows(batch), self._key_mask[:batch]
