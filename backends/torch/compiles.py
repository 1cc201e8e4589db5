"""How many graphs torch.compile has compiled in this process: read before and after a train
step, the difference is the step's `train/compiled_graphs`, so a step slowed by compiling (a
batch of a shape not seen before, the first steps of a run) says so in its record. And the
inductor options of parts compiled for training (`training_options`), without which the first
micro-batch under 4,096 tokens compiled them again.

The count is dynamo's own (`torch._dynamo.utils.counters`), process-wide: an engine in the same
process that compiles while the trainer steps (not colocated; colocated, it stands down for the
step) counts in it too.
"""

from __future__ import annotations

import sys
from typing import Any


def training_options() -> dict[str, Any]:
    """Inductor's mix-order reduction (a norm's weight gradient, summed over the tokens, fused
    with the row-wise reduction beside it) takes, in its strict mode, only inputs of at least
    4,096 rows, and guards the compiled graph on that: the first micro-batch of fewer tokens
    after larger ones compiles every part again, seconds in a train step (an H200 long-tail run:
    bench/results-h200.json, session_2026-12-04). Off, no part guards on its token count."""
    import torch._inductor.config as inductor  # where torch.compile is called, not at import

    return {"triton.mix_order_reduction": False} if hasattr(inductor.triton, "mix_order_reduction") else {}


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (0 where dynamo never ran)."""
    utils = sys.modules.get("torch._dynamo.utils")  # dynamo not imported: nothing compiled
    if utils is None:
        return 0
    return int(utils.counters["stats"].get("unique_graphs", 0))
