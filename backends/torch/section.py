"""The recipe's `model:` section for the torch backend."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from backends.torch.config import ModelConfig


class ModelSection(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Either `config` (a model built from random weights) or `path` (a Hugging Face directory).

    `threads`: torch intra-op threads (0 keeps torch's default).
    `cuda_graphs`: on a CUDA device the sampler replays its decode steps from CUDA graphs;
    `false` runs them eagerly.
    `residual`: the residual stream's dtype. `model` keeps it in `dtype`, as Hugging Face runs
    the model; `float32` keeps bf16 layers' sums in float32 (norms and projections still run in
    `dtype`), which makes the engine's and the trainer's logprobs agree more closely.
    """

    config: ModelConfig | None = None
    path: str | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: str = "cpu"
    threads: Annotated[int, msgspec.Meta(ge=0)] = 0
    cuda_graphs: bool = True
    residual: Literal["model", "float32"] = "model"

    def __post_init__(self) -> None:
        if (self.config is None) == (self.path is None):
            raise ValueError("give exactly one of model.config and model.path")


class TrainerOptions(msgspec.Struct, kw_only=True, frozen=True):
    """The trainers' own knobs (the torch and megatron backends'; megatron refuses some), taken
    from the recipe's `train` section, where they keep their names (`train.compile`, ...).

    `master_weights`: bf16 models step float32 master copies. `offload_optimizer`: masters and
    moments in pinned host memory between steps. `compile`: torch.compile each layer's
    position-wise parts. `activation_checkpointing`: recompute each layer in the backward pass.
    `tensor_parallel`: megatron's tensor-parallel ranks (one Ray actor each).
    `data_parallel`: data-parallel ranks, each of `tensor_parallel` actors.
    """

    master_weights: bool = True
    offload_optimizer: bool = False
    compile: bool = False
    activation_checkpointing: bool = False
    tensor_parallel: int = 1
    data_parallel: int = 1

    @property
    def ranks(self) -> int:
        """The trainer's ranks in all: one Ray actor each."""
        return self.tensor_parallel * self.data_parallel
