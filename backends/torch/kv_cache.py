"""The sampler's KV cache: every layer's keys and values laid out in one buffer of a `KVPool`.

Layout: per layer, keys then values, each [rows, kv_heads, length, head_dim]; `flat[layer]` is
both as [2 * rows * kv_heads * length, head_dim], so that one ``index_copy_`` writes a decode
step's new keys and values (`layer_project`'s ``writes``); `every` is the whole buffer as
[layers, 2, rows, kv_heads, length, head_dim], so that one indexing reads (or writes) given
positions of given rows in every layer at once (episodes' kept keys and values, `kv_keep.py`).
Row r keeps its own tokens at positions 0..n-1 (no left padding). The views are ordinary tensors
made outside inference mode: they outlive `Sampler.generate`'s inference-mode calls.

Lifecycle: `grow` lays out a larger cache (the old one's memory is given back first; its
contents are lost); `release` hands the memory back to the driver, `restore` maps it again
(contents undefined), at the same addresses where the pool keeps them (`KVPool.stable`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from backends.torch.config import ModelConfig
from backends.torch.kv_pool import KVPool


class KVCache:
    """``zero_fresh``: zero the keys and values of fresh memory, for attention that masks
    positions rather than not reading them (`attend`, not flash): masked positions still
    enter its products, and uninitialised memory may hold NaN, which a mask does not cancel
    (0 * NaN is NaN)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, pool: KVPool, *, zero_fresh: bool) -> None:
        self.layers = config.num_hidden_layers
        assert config.head_dim is not None  # ModelConfig resolves it
        self.kv_heads, self.head_dim = config.num_key_value_heads, config.head_dim
        self.dtype = dtype
        self.pool = pool
        self.zero_fresh = zero_fresh
        self.rows = 0
        self.length = 0
        self.flat: list[Tensor] = []
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.every = torch.empty(0)

    def fits(self, rows: int, length: int) -> bool:
        return rows <= self.rows and length <= self.length

    def grow(self, rows: int, length: int) -> None:
        """Lay out a cache of at least ``rows`` rows of ``length`` positions (and no fewer than
        now)."""
        self.rows, self.length = max(rows, self.rows), max(length, self.length)
        self.flat, self.keys, self.values, self.every = [], [], [], torch.empty(0)
        elements = 2 * self.layers * self.rows * self.kv_heads * self.length * self.head_dim
        with torch.inference_mode(False):
            self._view(self.pool.allocate(elements * torch.finfo(self.dtype).bits // 8))

    def release(self) -> None:
        self.pool.release()

    def restore(self) -> bool:
        """Map the memory again; True when the views moved (a pool that keeps no addresses)."""
        buffer = self.pool.restore()
        if not self.pool.stable:
            with torch.inference_mode(False):
                self._view(buffer)
            return True
        self._zero_fresh()
        return False

    @property
    def resident_bytes(self) -> int:
        return self.pool.resident_bytes

    def _view(self, buffer: Tensor) -> None:
        shape = (self.rows, self.kv_heads, self.length, self.head_dim)
        per = math.prod(shape) // self.head_dim
        flat = buffer.view(self.dtype).view(-1, self.head_dim)
        self.every = flat[: 2 * self.layers * per].view(self.layers, 2, *shape)
        self.flat = [flat[2 * i * per : (2 * i + 2) * per] for i in range(self.layers)]
        self.keys = [both[:per].view(shape) for both in self.flat]
        self.values = [both[per:].view(shape) for both in self.flat]
        self._zero_fresh()

    def _zero_fresh(self) -> None:
        if self.zero_fresh:
            for tensor in self.flat:
                tensor.zero_()
