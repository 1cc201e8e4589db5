"""What megatron-core 0.19 needs to run on a CPU-only torch build, applied in one place.

megatron-core has no CPU mode: it calls `torch.cuda` directly (660 lines in 114 files). On the
paths this backend uses, three calls matter: `torch.cuda.current_device()` (tensor-parallel
layers and rotary embeddings place tensors with it), `torch.cuda.synchronize()` (dist_checkpointing
waits for its device-to-host copies) and the CUDA RNG tracker that tensor-parallel layers fork for
dropout. `apply` makes the first return the CPU device and the second a no-op (CPU copies are
synchronous), and installs megatron's own no-op tracker (dropout is off in every model this
backend builds). It is a no-op where CUDA is available, and idempotent.
"""

from __future__ import annotations

import torch

_applied = False


def apply() -> None:
    global _applied
    if _applied or torch.cuda.is_available():
        return
    from megatron.core import tensor_parallel

    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    _applied = True
