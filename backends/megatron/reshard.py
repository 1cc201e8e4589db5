"""Our torch engine serving a megatron policy: a torch `Decoder` refreshed from megatron's weights.

`copy_into(decoder, model, config)` gathers each tensor-parallel rank's shard (an all-gather per
tensor; none at one rank), turns them into the Hugging Face layout (`layout.to_hf`: q/k/v split
by query group, gate/up split) and copies them into the decoder's parameters, device to device.

`ReshardingSampler` wraps the engine's sampler so that the engine's own hand-off points do it:
colocated, `wake` (the engine serves the trainer's newest weights on waking); separate,
`refresh` (called by the engine's `refit` after each step, and on resume).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import Tensor

from backends.megatron import layout
from backends.torch.config import ModelConfig
from backends.torch.fingerprint import Probe
from backends.torch.model import Decoder
from backends.torch.serving import BatchSampler
from pipeline.messages import Completion


def gathered(own: dict[str, Tensor]) -> list[dict[str, Tensor]]:
    """Every tensor-parallel rank's tensors of these names (parameters, gradients), in rank order."""
    size = parallel_state.get_tensor_model_parallel_world_size()
    if size == 1:
        return [own]
    shards: list[dict[str, Tensor]] = [{} for _ in range(size)]
    group = parallel_state.get_tensor_model_parallel_group()
    for name, tensor in own.items():
        parts = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(parts, tensor.detach().contiguous(), group=group)
        for shard, part in zip(shards, parts, strict=True):
            shard[name] = part
    return shards


@torch.no_grad()
def copy_into(decoder: Decoder, model: torch.nn.Module, config: ModelConfig) -> None:
    hf = layout.to_hf(gathered(layout.parameters(model)), config)
    for name, target in decoder.state_dict(keep_vars=True).items():
        target.copy_(hf[name])


class ReshardingSampler:
    """A `BatchSampler` whose `wake` and `refresh` first copy the megatron weights in."""

    def __init__(self, inner: BatchSampler, model: torch.nn.Module) -> None:
        self.inner = inner
        self.source = model
        self.model = inner.model
        self.device = inner.device

    def _copy(self) -> None:
        copy_into(self.inner.model, self.source, self.inner.model.config)

    def wake(self) -> None:
        self._copy()
        self.inner.wake()

    def refresh(self) -> None:
        self._copy()
        self.inner.refresh()

    def generate(self, prompts: list[list[int]], **kwargs: Any) -> list[Completion]:
        return self.inner.generate(prompts, **kwargs)

    def release(self) -> None:
        self.inner.release()

    def cache_bytes(self) -> int:
        return self.inner.cache_bytes()

    @property
    def layout(self) -> int:
        return self.inner.layout

    def probes(self) -> list[Probe]:
        return self.inner.probes()
