"""The learning-rate schedule of the trainers: linear warmup, then constant or cosine decay.

`lr_factor(update, ...)` is the multiplier of the base rate for optimizer update `update`
(0-based): (update + 1) / warmup over the first `warmup_updates`, then 1 (`constant`) or a cosine
from 1 down to `min_lr_ratio` at `total_updates` (`cosine`), flat after it.
"""

from __future__ import annotations

import math


def lr_factor(
    update: int, *, warmup_updates: int, total_updates: int, schedule: str, min_lr_ratio: float
) -> float:
    if update < warmup_updates:
        return (update + 1) / warmup_updates
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (update - warmup_updates) / max(1, total_updates - warmup_updates))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
