"""Our torch engine serving a megatron policy: a torch `Decoder` refreshed from megatron's weights.

`copy_into(decoder, model, config)` gathers each tensor-parallel rank's shard (an all-gather per
tensor; none at one rank), turns them into the Hugging Face layout (`layout.to_hf`: q/k/v split
by query group, gate/up split) and loads them into the decoder's parameters, device to device.
`served(model, config)` is what the decoder then holds, for the trainer's fingerprints.

The torch engine calls it as its `refresh_weights` at its own hand-off points: colocated, each
wake (the engine serves the trainer's newest weights on waking); separate, each refit (after
each step, and on resume).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import Tensor

from backends.megatron import layout
from backends.torch.config import ModelConfig
from backends.torch.model import Decoder


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


def hf_weights(model: torch.nn.Module, config: ModelConfig) -> dict[str, Tensor]:
    """The megatron model's weights, gathered, as a Hugging Face state dict."""
    return layout.to_hf(gathered(layout.parameters(model)), config)


@torch.no_grad()
def copy_into(decoder: Decoder, model: torch.nn.Module, config: ModelConfig) -> None:
    decoder.load_state_dict(hf_weights(model, config))  # copies into the decoder's own tensors


def as_parameters(hf: dict[str, Tensor], config: ModelConfig) -> list[tuple[str, Tensor]]:
    """A Hugging Face state dict as the engine's `Decoder` holds it: its parameters' names and
    layout, tied ones once. The Decoder's own `load_state_dict` lays them out, on a shell of it
    on the meta device."""
    with torch.device("meta"):
        shell = Decoder(config)
    names = [name for name, _ in shell.named_parameters()]
    shell.load_state_dict(hf, assign=True)
    params = dict(shell.named_parameters(remove_duplicate=False))
    return [(name, params[name].detach().contiguous()) for name in names]


def served(model: torch.nn.Module, config: ModelConfig) -> list[tuple[str, Tensor]]:
    """The megatron model's weights as the engine's `Decoder` holds them after `copy_into` (what
    the engine's fingerprints probe)."""
    return as_parameters(hf_weights(model, config), config)
