"""The run's metrics: `metrics.jsonl` (one JSON object per train step), `eval.jsonl` (one per
held-out evaluation, step 0 being the baseline before training), and the recipe's sinks.

Non-finite values never reach a file or a sink: they are left out of the record and counted
under `metrics/nonfinite_dropped`. A sink that fails (wandb losing its connection) is reported
once and switched off; the files are the record of truth.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.sinks import Sink

log = logging.getLogger("pipeline.metrics")

STEPS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"

# docs/DESIGN.md, "What a run leaves behind": on every line of metrics.jsonl.
REQUIRED_KEYS = frozenset(
    {
        "step",
        "policy_version",
        "reward/mean",
        "train/loss",
        "train/grad_norm",
        "train/gen_kl_error",
        "train/token_mult_prob_error",
        "rollout/max_lag",
        "rollout/timeouts",
        "rollout/poisoned_samples",
        "timing/step_s",
        "throughput/tokens_per_s_per_gpu",
    }
)


class MetricsLog:
    def __init__(self, run_dir: Path, sinks: Sequence[Sink] = ()) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self._steps = (run_dir / STEPS_FILE).open("a", buffering=1)
        self._evals = (run_dir / EVAL_FILE).open("a", buffering=1)
        self._sinks = list(sinks)
        self.last: dict[str, Any] = {}

    def write(self, record: dict[str, Any]) -> dict[str, Any]:
        """One train step's record; returns it as written."""
        self.last = self._emit(self._steps, record)
        return self.last

    def write_eval(self, record: dict[str, Any]) -> dict[str, Any]:
        """One evaluation's record (with its `step`); returns it as written."""
        return self._emit(self._evals, record)

    def _emit(self, file: Any, record: dict[str, Any]) -> dict[str, Any]:
        clean = finite(record)
        file.write(json.dumps(clean) + "\n")
        for sink in list(self._sinks):
            try:
                sink.log(clean, int(clean.get("step", 0)))
            except Exception as error:
                log.warning("metrics sink %s failed, switching it off: %s", type(sink).__name__, error)
                self._sinks.remove(sink)
        return clean

    def close(self) -> None:
        self._steps.close()
        self._evals.close()
        for sink in self._sinks:
            try:
                sink.close()
            except Exception as error:
                log.warning("closing metrics sink %s failed: %s", type(sink).__name__, error)


def finite(record: dict[str, Any]) -> dict[str, Any]:
    """`record` without non-finite floats, counting them under `metrics/nonfinite_dropped`."""
    clean = {k: v for k, v in record.items() if not (isinstance(v, float) and not math.isfinite(v))}
    if len(clean) < len(record):
        clean["metrics/nonfinite_dropped"] = len(record) - len(clean)
    return clean


def read(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSONL metrics file (a line cut short by a kill, or garbled, is skipped)."""
    records = []
    with path.open("rb") as lines:
        for line in lines:
            if line.strip():
                try:
                    records.append(json.loads(line))
                except ValueError:  # not JSON, or not UTF-8
                    continue
    return records


def per_evaluation(name: str) -> bool:
    """Whether `name` is read from eval.jsonl (one value per evaluation), not metrics.jsonl."""
    return (name.startswith("eval/") and name != "eval/skipped") or name == "timing/eval_s"
