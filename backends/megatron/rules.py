"""Where megatron's inference engine can serve: its cross-field rules against the rest of the
recipe, checked by the shell's root recipe (so `validate` and `run` refuse alike)."""

from __future__ import annotations

from typing import Any

from backends.placement import RayPlacement


def check_engine(recipe: Any) -> None:
    """Cross-field rules of `rollout.engine` against the rest of the recipe (ValueError naming
    both). megatron's engine serves the megatron trainer's module where it lies: one process,
    colocated, CUDA (its dynamic context allocates with CUDA only), bf16 (its attention runs
    flash-attention kernels)."""
    rollout = recipe.rollout
    if rollout.engine == "torch":
        if rollout.kv_cache_gb:
            raise ValueError(
                f"rollout.kv_cache_gb: {rollout.kv_cache_gb:g} sizes the KV cache of rollout.engine "
                "megatron; the torch engine sizes its own for each decode loop: leave it at 0"
            )
        if rollout.graphs:
            raise ValueError(
                "rollout.graphs: true turns on the CUDA graphs of rollout.engine megatron; the "
                "torch engine always replays its decode steps from graphs on CUDA: leave it at false"
            )
        return
    if recipe.train.backend != "megatron":
        raise ValueError(
            f"rollout.engine: megatron needs train.backend: megatron (it serves the megatron "
            f"trainer's own model), got {recipe.train.backend}; set train.backend: megatron or "
            "rollout.engine: torch"
        )
    if not recipe.colocated:
        raise ValueError(
            "rollout.engine: megatron needs colocated: true (it serves the trainer's model in place; "
            "a separate engine would need a model of its own and a weight copy after each step); set "
            "colocated: true or rollout.engine: torch"
        )
    if not recipe.model.device.startswith("cuda"):
        raise ValueError(
            f"rollout.engine: megatron needs model.device: cuda (megatron's dynamic inference context "
            f"allocates its KV cache and bookkeeping on CUDA only), got {recipe.model.device}; set "
            "rollout.engine: torch"
        )
    if recipe.model.dtype != "bfloat16":
        raise ValueError(
            f"rollout.engine: megatron needs model.dtype: bfloat16 (its attention runs flash-attention "
            f"kernels, which take bf16), got {recipe.model.dtype}"
        )
    if isinstance(recipe.placement, RayPlacement):
        raise ValueError(
            "rollout.engine: megatron is not built for placement.backend ray yet: set "
            "placement.backend: local or rollout.engine: torch"
        )
    if rollout.partial:
        raise ValueError(
            "rollout.partial: true needs rollout.engine: torch (the weights version of each token of "
            "a continued request is the torch engine's bookkeeping); set rollout.partial: false"
        )
