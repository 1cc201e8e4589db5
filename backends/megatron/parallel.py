"""Megatron's process groups for this process.

megatron-core needs `torch.distributed` and its model-parallel groups before any model is built.
A pipeline process is one rank: `initialise` starts a world of one (gloo on CPU, NCCL on CUDA,
an in-memory store, so no port is taken) unless the caller (a test, a launcher of several ranks)
has started one, and sets up megatron's groups with `tensor_parallel` ranks if nobody has; on
CUDA it seeds megatron's RNG tracker.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from backends.megatron import cpu_shims


def initialise(*, tensor_parallel: int = 1, device: torch.device, seed: int = 0) -> None:
    if device.type == "cpu":
        cpu_shims.apply()
    if not dist.is_initialized():
        cuda = device.type == "cuda"
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            # NCCL's barriers (dist_checkpointing's) warn at every call unless told the device.
            device_id=torch.device("cuda", torch.cuda.current_device()) if cuda else None,
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    elif parallel_state.get_tensor_model_parallel_world_size() != tensor_parallel:
        raise ValueError(
            f"megatron's groups are set up for tensor parallel "
            f"{parallel_state.get_tensor_model_parallel_world_size()}, not {tensor_parallel}"
        )
    if device.type == "cuda":
        # Megatron draws its initial weights (and dropout) from the CUDA states of its RNG
        # tracker, which start empty ("cuda rng state model-parallel-rng is not added").
        model_parallel_cuda_manual_seed(seed)
