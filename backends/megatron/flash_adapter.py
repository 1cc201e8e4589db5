"""The flash-attention functions megatron-core's dynamic inference engine calls, over torch's own
flash-attention kernel, for machines with no flash-attn package.

Megatron's dynamic engine attends through `flash_attn.flash_attn_varlen_func` (prefill, and
mixed prefill/decode steps) and `flash_attn.flash_attn_with_kvcache` (decode-only steps), both
over its paged KV cache ([blocks, block_tokens, kv_heads, D] with a block table per request).
No flash-attn 2 or 3 wheel exists for the GPU machine, and torch's
`aten._flash_attention_forward` (torch 2.11) takes no block table, so `install` gives megatron
these two functions with each call's blocks gathered into one contiguous run per request
(the rows' keys then values are copied once per layer and step: the price of this route).
Megatron's block table has a column for every block of its longest possible sequence; only the
blocks of the step's longest row are gathered (`_used`), so the copy follows the rows' lengths,
not the context's `max_sequence_length` (decode steps find that length on the device: one
host sync per layer). A call being captured into a CUDA graph (megatron's decode graphs) can
neither sync nor size its copy to the rows it will replay for: it gathers every column, so a
graphed step copies `max_sequence_length` keys per row whatever the rows hold.

Decode steps on CUDA with Triton (`paged_decode.supports`) skip the copy: `paged_decode`'s
kernel reads each row's own blocks through the table, with no sync, graphed or not. The gather
stays for prefill and mixed steps, and for decode where the kernel does not run.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from backends.torch import paged_decode

# What megatron's version check reads (`is_fa_min_version("2.7.3")` for dynamic batching).
_VERSION = "2.8.3"


def install() -> None:
    """Make `import flash_attn` give these functions, and hand them to megatron's attention
    module if it was imported first. Leaves a real flash-attn 2 package alone; flash-attn-4
    alone installs `flash_attn` as a namespace of its `flash_attn.cute` (no 2.x functions):
    these go into it."""
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        module = types.ModuleType("flash_attn")
        # A spec, as an imported module has: importlib.util.find_spec (transformers' probe of
        # installed packages) raises on a module in sys.modules without one.
        module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
        sys.modules["flash_attn"] = module
    flash = sys.modules["flash_attn"]
    if getattr(flash, "flash_attn_varlen_func", None) is None:
        flash.__version__ = _VERSION  # type: ignore[attr-defined]
        flash.flash_attn_varlen_func = flash_attn_varlen_func  # type: ignore[attr-defined]
        flash.flash_attn_with_kvcache = flash_attn_with_kvcache  # type: ignore[attr-defined]
    attention = sys.modules.get("megatron.core.transformer.attention")
    if attention is not None and getattr(attention, "flash_attn_varlen_func", None) is None:
        attention.flash_attn_varlen_func = flash.flash_attn_varlen_func  # type: ignore[attr-defined]
        attention.flash_attn_with_kvcache = flash.flash_attn_with_kvcache  # type: ignore[attr-defined]


# rollout.attention -> the FlashAttention generation megatron's inference attention runs.
_GENERATION = {"adapter": 2, "flash-attn-4": 4}


def pin(model: Any, attention: str, *, one_split: bool = False) -> None:
    """Pin the inference attention of `model`'s layers to `attention` (`rollout.attention`):
    `adapter`, these functions (megatron's flash-attn 2 calls), even where flash-attn-4 is
    installed (megatron would prefer it); `flash-attn-4`, megatron's own path over that
    package. Only the engine's path reads it: training attends through its own core attention.

    `one_split` (`single_split(device)`): flash-attn-4's SM 9.0 kernels take no split of the keys
    ("SplitKV not supported on SM 9.0"), and megatron asks its split heuristic (`num_splits` 0),
    which splits narrow decode steps, unless the layer's `batch_invariant_mode` is set; megatron
    reads that flag there only for `num_splits` (and to refuse flash-attn 2, which the adapter's
    generation never reaches with it off)."""
    generation = _GENERATION[attention]
    for module in model.modules():
        if hasattr(module, "flash_attention_version"):  # megatron's attention layers (its config's)
            module.flash_attention_version = generation
            module.batch_invariant_mode = generation == 4 and one_split


def single_split(device: Any) -> bool:
    """Whether flash-attn-4 must attend with one split of the keys on `device` (Hopper)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def _full_window(window_size: tuple[int, int]) -> None:
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(
            f"sliding-window attention (window_size={window_size}) is not supported here"
        )


def _gathered(cache: Tensor, block_table: Tensor) -> Tensor:
    """Each request's blocks of a paged cache in order: [rows * M * block_tokens, kv_heads, D]
    for a block table [rows, M] (unused entries may be negative: any block serves, unread)."""
    return cache.index_select(0, block_table.reshape(-1).clamp(min=0)).flatten(0, 1)


def _used(block_table: Tensor, rows: int, longest: Callable[[], int], block_tokens: int) -> Tensor:
    """The first `rows` rows of a block table, cut to the blocks a row of `longest()` tokens
    uses (later columns are unused by every row); every column while a CUDA graph is being
    captured (`longest` is not asked: it may sync with the device)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return block_table[:rows]
    return block_table[:rows, : -(-longest() // block_tokens)]


def _paged(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_q: Tensor,
    max_q: int,
    used: Tensor,
    scale: float | None,
    causal: bool,
    block_table: Tensor,
) -> tuple[Tensor, Tensor]:
    rows, blocks = block_table.shape
    width = blocks * k_cache.shape[1]
    cu_k = torch.arange(0, (rows + 1) * width, width, dtype=torch.int32, device=q.device)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q,
        _gathered(k_cache, block_table),
        _gathered(v_cache, block_table),
        cu_q,
        cu_k,
        max_q,
        width,
        0.0,
        causal,
        False,
        scale=scale,
        seqused_k=used.to(torch.int32),
    )
    return out, lse


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    block_table: Tensor | None = None,
    return_attn_probs: bool = False,
    **_: Any,
) -> Any:
    """flash-attn 2's variable-length attention; with `block_table`, k and v are paged caches
    and `cu_seqlens_k` gives each request's key count."""
    _full_window(window_size)
    if block_table is None:
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            0.0,
            causal,
            False,
            scale=softmax_scale,
        )
    else:
        rows = cu_seqlens_k.numel() - 1
        out, lse = _paged(
            q,
            k,
            v,
            cu_seqlens_q,
            max_seqlen_q,
            cu_seqlens_k.diff(),
            softmax_scale,
            causal,
            _used(block_table, rows, lambda: max_seqlen_k, k.shape[1]),
        )
    return (out, lse, None) if return_attn_probs else out


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    block_table: Tensor | None = None,
    return_softmax_lse: bool = False,
    **_: Any,
) -> Any:
    """flash-attn 2's attention of new queries q [B, S, H, D] over a paged cache (their own keys
    already in it): by `paged_decode` where it runs (its logsumexp [B, H, S], as flash-attn's),
    else by `gathered_decode`."""
    _full_window(window_size)
    if block_table is None:
        raise NotImplementedError("flash_attn_with_kvcache without a block table")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    if paged_decode.supports(q, k_cache, v_cache, block_table, cache_seqlens):
        out, lse = paged_decode.attend(q, k_cache, v_cache, block_table, cache_seqlens, scale, causal)
    else:
        out, lse = gathered_decode(q, k_cache, v_cache, block_table, cache_seqlens, scale, causal)
    return (out, lse) if return_softmax_lse else out


def gathered_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cache_seqlens: Tensor,
    scale: float,
    causal: bool,
) -> tuple[Tensor, Tensor]:
    """`flash_attn_with_kvcache`'s attention over the rows' blocks gathered into contiguous keys
    (module docstring), with the logsumexp [B, H, S] as flash-attn's (torch's varlen kernel
    gives it [H, B * S]; megatron's sink-softmax correction reads [B, H, S])."""
    b, s, h, d = q.shape
    cu_q = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=q.device)
    out, lse = _paged(
        q.reshape(b * s, h, d),
        k_cache,
        v_cache,
        cu_q,
        s,
        cache_seqlens,
        scale,
        causal,
        _used(block_table, b, lambda: int(cache_seqlens[:b].max()), k_cache.shape[1]),
    )
    return out.view(b, s, h, d), lse.view(h, b, s).transpose(0, 1)
