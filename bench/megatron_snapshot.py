"""What the parts of a megatron-backend snapshot cost (issue 34), on the GPU: the 1.5B-shaped
GPTModel (bf16) in megatron's distributed optimizer (`MegatronAdam`), its Adam state made as a
first step makes it. Times `GPTModel.sharded_state_dict`; the optimizer's save state as megatron
builds it ("fully_reshardable": gathered into fresh host tensors, what the trainer snapshotted
before) and as `param_state.live` gives it (views of the live tensors); `HostCopier.reserve`
(off the step, after the first) and `HostCopier.copy` of each state into that reserved buffer
(the step's stall), with the bytes of each state and the buffers allocated. One JSON line.

    python -m bench.megatron_snapshot
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any

import msgspec
import torch

from backends.megatron import checkpoint, parallel, param_state
from backends.megatron.model import build_gpt_model
from backends.megatron.optimizer import MegatronAdam
from backends.torch.host_copy import HostCopier, _plan
from bench.gpu import QWEN_1_5B


def _timed(fn: Any) -> tuple[Any, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def measure(step: MegatronAdam) -> dict[str, Any]:
    """Each part's seconds and gigabytes for `step`'s model and optimizer (see the docstring)."""
    model = step.model.module
    out: dict[str, Any] = {}

    def state(gather: bool) -> dict[str, Any]:
        model_state, out["model_state_s"] = _timed(model.sharded_state_dict)
        if gather:
            metadata = {"distrib_optim_sharding_type": param_state.FORMAT}
            optimizer, seconds = _timed(
                lambda: step.optimizer.sharded_state_dict(model_state, is_loading=False, metadata=metadata)
            )
        else:
            optimizer, seconds = _timed(lambda: step.sharded_state_dict(model_state, loading=False))
        out[("gathered" if gather else "live") + "_optimizer_state_s"] = seconds
        return {"model": model_state, "optimizer": optimizer}

    host = HostCopier()
    reserved = state(gather=False)
    start = time.perf_counter()
    host.reserve(reserved, leaf=checkpoint.sharded_leaf)
    host.wait()
    out["reserve_s"] = time.perf_counter() - start
    out["reserved_gb"] = host.arena.numel() / 1e9 if host.arena is not None else 0.0
    del reserved
    for name, gather in (("gathered", True), ("live", False), ("live_again", False)):
        snapshot, seconds = _timed(lambda gather=gather: state(gather))
        tensors, nbytes, _ = _plan(snapshot, checkpoint.sharded_leaf)
        on_gpu = sum(t.numel() * t.element_size() for t, _ in tensors.values() if t.is_cuda)
        copy, copy_s = _timed(lambda snapshot=snapshot: host.copy(snapshot, leaf=checkpoint.sharded_leaf))
        out[f"{name}_state_s"], out[f"{name}_copy_s"], out[f"{name}_snapshot_s"] = (
            seconds,
            copy_s,
            seconds + copy_s,
        )
        out[f"{name}_gb"], out[f"{name}_on_gpu_gb"] = nbytes / 1e9, on_gpu / 1e9
        del snapshot, copy, tensors
        gc.collect()
    out["arenas_allocated"] = host.allocations
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=QWEN_1_5B.num_hidden_layers)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.megatron_snapshot needs a CUDA device (the 1.5B shape on one GPU)")
    cuda = torch.device("cuda")
    parallel.initialise(device=cuda)
    config = msgspec.structs.replace(QWEN_1_5B, num_hidden_layers=args.layers)
    model = build_gpt_model(config, dtype=torch.bfloat16, device=cuda)
    step = MegatronAdam(model, lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0, grad_clip=1.0)
    step._fresh_state()  # the masters' Adam state, as the first step leaves it
    out = {"layers": args.layers, **measure(step)}
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
