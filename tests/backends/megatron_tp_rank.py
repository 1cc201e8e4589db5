"""One rank of the tensor- and data-parallel tests
(`python -m tests.backends.megatron_tp_rank RANK SIZE PORT OUT [TP]`: SIZE ranks in all, TP of
them a tensor-parallel group, default SIZE).

Builds the test's model as this rank's shard, runs one train step on the shared groups and
writes (rank 0) the step's metrics, and the weights before and after the step and the (clipped)
gradients gathered back to the Hugging Face layout, to OUT; and a checkpoint beside OUT.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(rank: int, size: int, port: int, out: str, tp: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    from backends.megatron import layout, parallel, reshard
    from backends.torch.model import Decoder
    from tests.backends.megatron_cases import groups
    from tests.backends.megatron_tp_case import CONFIG, trainer

    parallel.initialise(tensor_parallel=tp, device=torch.device("cpu"))
    torch.manual_seed(0)
    hf = Decoder(CONFIG).state_dict()
    ours = trainer(hf, rank=rank % tp, size=tp)
    before = layout.to_hf(reshard.gathered(layout.parameters(ours.model)), CONFIG)
    metrics = ours._train_step(groups())
    grads = layout.to_hf(reshard.gathered({n: p.grad for n, p in ours.model.named_parameters()}), CONFIG)
    after = layout.to_hf(reshard.gathered(layout.parameters(ours.model)), CONFIG)
    ours.save(Path(out).parent)  # a checkpoint of every rank's shards
    if rank == 0:
        torch.save({"metrics": metrics, "before": before, "grads": grads, "after": after}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    size = int(sys.argv[2])
    main(
        int(sys.argv[1]), size, int(sys.argv[3]), sys.argv[4], int(sys.argv[5]) if len(sys.argv) > 5 else size
    )
