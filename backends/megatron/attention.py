"""Core attention for megatron's local layer spec through torch SDPA.

The spec's `DotProductAttention` multiplies out the [b, heads, s, s] score matrix (baddbmm, then
softmax); `SdpaAttention` hands queries, keys and values to
`torch.nn.functional.scaled_dot_product_attention` (flash or memory-efficient kernels on a GPU),
causal, with grouped-query heads served without repeating keys and values. It takes the
constructor and forward arguments megatron passes its core attention.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch import Tensor


class SdpaAttention(MegatronModule):
    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        assert config.context_parallel_size == 1, "SdpaAttention has no context parallelism"
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.grouped = divide(config.num_attention_heads, tp) != divide(config.num_query_groups, tp)
        self.softmax_scale = softmax_scale  # None: 1/sqrt(head_dim), as SDPA's default

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        """[sq, b, heads, d] queries over [sk, b, groups, d] keys/values, causally; [sq, b, heads * d].

        Sequences are right-padded, so causality alone keeps real tokens off the padding: the
        attention mask megatron passes (None here) is not needed."""
        assert attention_bias is None and packed_seq_params is None
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=self.grouped
        )
        sq, b = query.shape[:2]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)
