"""How many graphs torch.compile has compiled in this process: read before and after a train
step, the difference is the step's `train/compiled_graphs`, so a step slowed by compiling (a
batch of a shape not seen before, the first steps of a run) says so in its record.

The count is dynamo's own (`torch._dynamo.utils.counters`), process-wide: an engine in the same
process that compiles while the trainer steps (not colocated; colocated, it stands down for the
step) counts in it too.
"""

from __future__ import annotations

import sys


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (0 where dynamo never ran)."""
    utils = sys.modules.get("torch._dynamo.utils")  # dynamo not imported: nothing compiled
    if utils is None:
        return 0
    return int(utils.counters["stats"].get("unique_graphs", 0))
