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
        clean = finite(record)
        self._file.write(json.dumps(clean) + "\n")
        if self._wandb is not None:
            self._wandb.log(clean, step=clean.get("step"))
        self.last = clean
        return clean

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def finite(record: dict[str, Any]) -> dict[str, Any]:
    """`record` without non-finite floats, counting them under `metrics/nonfinite_dropped`."""
    clean = {k: v for k, v in record.items() if not (isinstance(v, float) and not math.isfinite(v))}
    if len(clean) < len(record):
        clean["metrics/nonfinite_dropped"] = len(record) - len(clean)
    return clean


def read(path: Path) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl file."""
    with path.open() as lines:
        return [json.loads(line) for line in lines if line.strip()]
