"""Per-step metrics: one JSON object per line in `run.dir/metrics.jsonl`, and wandb if enabled.

Non-finite values never reach a log: they are left out of the record and counted under
`metrics/nonfinite_dropped`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsLog:
    def __init__(self, path: Path, *, wandb_run: Any = None) -> None:
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)
        self._wandb = wandb_run
        self.last: dict[str, Any] = {}

    def write(self, record: dict[str, Any]) -> dict[str, Any]:
        clean: dict[str, Any] = {}
        dropped = 0
        for key, value in record.items():
            if isinstance(value, float) and not math.isfinite(value):
                dropped += 1
                continue
            clean[key] = value
        if dropped:
            clean["metrics/nonfinite_dropped"] = dropped
        self._file.write(json.dumps(clean) + "\n")
        if self._wandb is not None:
            self._wandb.log(clean, step=clean.get("step"))
        self.last = clean
        return clean

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def read(path: Path) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl file."""
    with path.open() as lines:
        return [json.loads(line) for line in lines if line.strip()]
