"""The run context: what every stage of one run shares, made once by `stages.program`.

`clock` is the suspendable deadline clock every deadline hangs off (its `source` the run's time);
`trace` gathers stage spans and gate transitions (trace.json); `watchdog` is told what each stage
waits on; `timings` collects each batch's per-stage seconds for its metrics line; `metrics`
writes metrics.jsonl and eval.jsonl (and the sinks). Stages take the context instead of each of
these, so a new shared service is added in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.clock import DeadlineClock
from pipeline.metrics import MetricsLog
from pipeline.trace import Trace
from pipeline.watchdog import Watchdog
from stages.timings import BatchTimings


@dataclass(frozen=True)
class RunContext:
    clock: DeadlineClock
    trace: Trace
    watchdog: Watchdog
    timings: BatchTimings
    metrics: MetricsLog
