"""The recipe's `model:` section for the torch backend."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from backends.torch.config import ModelConfig


class ModelSection(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Either `config` (a model built from random weights) or `path` (a Hugging Face directory).

    `threads`: torch intra-op threads (0 keeps torch's default).
    """

    config: ModelConfig | None = None
    path: str | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: str = "cpu"
    threads: Annotated[int, msgspec.Meta(ge=0)] = 0

    def __post_init__(self) -> None:
        if (self.config is None) == (self.path is None):
            raise ValueError("give exactly one of model.config and model.path")
