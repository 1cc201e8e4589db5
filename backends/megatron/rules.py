"""Where megatron's inference engine can serve: its cross-field rules against the rest of the
recipe, checked by the shell's root recipe (so `validate` and `run` refuse alike)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from backends.torch.section import ModelSection
from pipeline.contracts.backend_input import Sampling


def check_engine(rollout: Sampling, *, backend: str, model: ModelSection, tensor_parallel: int) -> None:
    """Cross-field rules of `rollout.engine` against the rest of the recipe (ValueError naming
    both). megatron's engine serves the megatron trainer's module (colocated: in its process, or
    its rank's Ray actor) or a copy of it (apart: in its process, or a Ray replica of its own):
    CUDA (its dynamic context allocates with CUDA only), bf16 (its attention runs
    flash-attention kernels), one tensor-parallel rank (it runs one rank's forward alone);
    partial rollouts recompute the requests they continue, which its graphs' persistent cache
    does not."""
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
        if rollout.attention != "adapter":
            raise ValueError(
                f"rollout.attention: {rollout.attention} picks the attention kernels of rollout.engine "
                "megatron; the torch engine runs its own: leave it at adapter"
            )
        return
    if backend != "megatron":
        raise ValueError(
            f"rollout.engine: megatron needs train.backend: megatron (it serves the megatron "
            f"trainer's own model), got {backend}; set train.backend: megatron or "
            "rollout.engine: torch"
        )
    if not model.device.startswith("cuda"):
        raise ValueError(
            f"rollout.engine: megatron needs model.device: cuda (megatron's dynamic inference context "
            f"allocates its KV cache and bookkeeping on CUDA only), got {model.device}; set "
            "rollout.engine: torch"
        )
    if model.dtype != "bfloat16":
        raise ValueError(
            f"rollout.engine: megatron needs model.dtype: bfloat16 (its attention runs flash-attention "
            f"kernels, which take bf16), got {model.dtype}"
        )
    if tensor_parallel > 1:
        raise ValueError(
            f"rollout.engine: megatron is not built for train.tensor_parallel: {tensor_parallel} yet "
            "(it would run one rank's shard of the model, whose forward needs every rank); set "
            "train.tensor_parallel: 1 or rollout.engine: torch"
        )
    if rollout.attention == "flash-attn-4" and (missing := flash_attn_4_missing()):
        raise ValueError(
            f"rollout.attention: flash-attn-4 needs the flash-attn-4 package, {MIN_FLASH_ATTN_4} or "
            f"later ({missing}); `pip install flash-attn-4`, or set rollout.attention: adapter"
        )
    if rollout.partial and rollout.graphs:
        raise ValueError(
            "rollout.partial: true with rollout.engine megatron needs rollout.graphs: false (graphs "
            "keep megatron's KV cache across a stand-down, so a frozen request would hold it through "
            "the train step and continue over keys of the old weights; without graphs it is "
            "recomputed under the new ones); set rollout.graphs: false or rollout.partial: false"
        )


# The first flash-attn-4 release megatron-core's attention takes (its own check, by the same name).
MIN_FLASH_ATTN_4 = "4.0.0b20"


def flash_attn_4_missing() -> str | None:
    """Why flash-attn-4 cannot serve (not installed, older than `MIN_FLASH_ATTN_4`, or installed
    but its kernels' module does not import, which megatron takes for not installed and fails
    the run's first forward on), or None."""
    from packaging.version import InvalidVersion, Version  # megatron-core's own dependency

    try:
        found = version("flash-attn-4")
    except PackageNotFoundError:
        return "it is not installed"
    try:
        if Version(found) < Version(MIN_FLASH_ATTN_4):
            return f"{found} is installed"
    except InvalidVersion:
        return f"its version {found!r} is not one pip writes"
    try:
        from flash_attn.cute import flash_attn_varlen_func  # noqa: F401  megatron's own import of it
    except (ImportError, OSError) as error:  # a module or a shared library it loads missing
        return f"{found} is installed but does not import: {error}"
    return None
