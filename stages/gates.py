"""Metric gates: what a good run looks like, stated in the recipe, and the run's verdict on it.

A gate checks one statistic of one metric over a run's records: `median`, `mean`, `max`, `min`,
`last`, or `at` one step; over the steps `first_step`..`last_step` (inclusive, both optional);
with `healthy_only`, over the train steps that had no poisoned samples
(`rollout/poisoned_samples == 0`); against one bound (`lt`, `le`, `gt` or `ge`). A metric of
`eval.jsonl` (`eval/...`, `timing/eval_s`) is taken over evaluations (step 0 is the baseline
before training), any other over train steps (`metrics.jsonl`).

`evaluate_gates(run_dir, gates)` reads a run directory, finished, stopped or resumed, and returns
its `Verdict`; it runs nothing. Where a step has several records (a resumed run may repeat the
steps logged after its checkpoint) the last one counts. A gate whose metric has no value in the
selected steps fails with that reason; one whose steps all lie past the run's planned last step
(`run.steps`, when given: a run shortened by an override), or past the step where a clean stop
ended the run, is skipped and says so, and counts as neither passed nor failed (a stop whose
steps pass their gates passes). `give_verdict` is what a run calls at its end (and on a clean
stop): it evaluates, writes `run_dir/gates.json` and logs a line per gate.
"""

from __future__ import annotations

import json
import logging
import math
import operator
import statistics
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Literal

import msgspec

from pipeline.contracts.sections import NonNegativeInt, Section
from pipeline.metrics import EVAL_FILE, STEPS_FILE, per_evaluation, read

log = logging.getLogger("stages.gates")

VERDICT_FILE = "gates.json"
HEALTHY_KEY = "rollout/poisoned_samples"

Statistic = Literal["median", "mean", "max", "min", "last", "at"]

_STATISTICS: dict[str, Callable[[list[float]], float]] = {
    "median": statistics.median,
    "mean": statistics.fmean,
    "max": max,
    "min": min,
    "last": lambda values: values[-1],
    "at": lambda values: values[-1],
}
_BOUNDS: dict[str, tuple[str, Callable[[float, float], bool]]] = {
    "lt": ("<", operator.lt),
    "le": ("<=", operator.le),
    "gt": (">", operator.gt),
    "ge": (">=", operator.ge),
}


class Gate(Section, frozen=True):
    metric: str
    stat: Statistic
    step: NonNegativeInt | None = None  # the step of `stat: at`
    first_step: NonNegativeInt | None = None
    last_step: NonNegativeInt | None = None
    healthy_only: bool = False
    lt: float | None = None
    le: float | None = None
    gt: float | None = None
    ge: float | None = None

    def __post_init__(self) -> None:
        given = [name for name in _BOUNDS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                f"{self.metric}: give exactly one bound (lt, le, gt or ge), got "
                + (", ".join(given) if given else "none")
            )
        if self.stat == "at" and self.step is None:
            raise ValueError(f"{self.metric}: stat: at needs the step to read (step: N)")
        if self.stat != "at" and self.step is not None:
            raise ValueError(f"{self.metric}: step is for stat: at; a range is first_step/last_step")
        if self.stat == "at" and (self.first_step is not None or self.last_step is not None):
            raise ValueError(f"{self.metric}: stat: at takes one step, not first_step/last_step")
        if self.first_step is not None and self.last_step is not None and self.first_step > self.last_step:
            raise ValueError(
                f"{self.metric}: first_step ({self.first_step}) must be <= last_step ({self.last_step})"
            )
        if self.healthy_only and per_evaluation(self.metric):
            raise ValueError(f"{self.metric}: healthy_only selects train steps, not evaluations")

    @property
    def bound(self) -> tuple[str, float]:
        """(`lt`|`le`|`gt`|`ge`, its value)."""
        return next((name, value) for name in _BOUNDS if (value := getattr(self, name)) is not None)

    @property
    def name(self) -> str:
        """E.g. `median(train/token_mult_prob_error, steps 2-4, healthy)`."""
        where = []
        if self.stat == "at":
            where.append(f"step {self.step}")
        elif self.first_step is not None or self.last_step is not None:
            first = "" if self.first_step is None else self.first_step
            last = "" if self.last_step is None else self.last_step
            where.append(f"steps {first}-{last}")
        if self.healthy_only:
            where.append("healthy")
        return f"{self.stat}({', '.join([self.metric, *where])})"


class GatesSection(Section, frozen=True):
    checks: tuple[Gate, ...] = ()
    fail: bool = True  # a failed gate makes `python -m pipeline run` exit 3


class GateResult(msgspec.Struct, frozen=True, kw_only=True):
    gate: str  # Gate.name
    metric: str
    stat: str
    bound: str  # e.g. "< 1.02"
    value: float | None
    passed: bool
    num_values: int  # the steps the statistic was taken over
    reason: str | None = None  # why a gate without a value failed, or was skipped
    skipped: bool = False  # its steps lie past the run's planned last step, or its stop


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    passed: bool
    results: tuple[GateResult, ...] = ()

    def summary(self) -> str:
        """`gates: all 5 passed`, `gates: 1 of 5 failed`, `gates: all 4 passed, 1 skipped`."""
        failed = sum(not result.passed for result in self.results)
        skipped = sum(result.skipped for result in self.results)
        total = len(self.results) - skipped
        text = f"gates: {failed} of {total} failed" if failed else f"gates: all {total} passed"
        return text + (f", {skipped} skipped" if skipped else "")


def by_step(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Records by step, in step order; of repeated steps the last record counts."""
    last = {int(r["step"]): r for r in records if isinstance(r.get("step"), int)}
    return dict(sorted(last.items()))


def evaluate_gates(
    run_dir: Path, gates: GatesSection, *, steps: int | None = None, stopped_at: int | None = None
) -> Verdict:
    """The verdict of `gates` on the records in `run_dir` (nothing is run); ``steps``: the run's
    planned last step (`run.steps`); ``stopped_at``: the last step of a run stopped before it (a
    clean stop: its gates on later steps are skipped, as a shortened run's are)."""
    files = {name: run_dir / name for name in (STEPS_FILE, EVAL_FILE)}
    records = {name: by_step(read(path)) if path.exists() else {} for name, path in files.items()}
    healthy = {step for step, r in records[STEPS_FILE].items() if r.get(HEALTHY_KEY) == 0}
    reach = _Reach(steps, stopped_at)
    results = []
    for gate in gates.checks:
        source = EVAL_FILE if per_evaluation(gate.metric) else STEPS_FILE
        results.append(_evaluate(gate, records[source], healthy, reach))
    return Verdict(passed=all(r.passed for r in results), results=tuple(results))


class _Reach(msgspec.Struct, frozen=True):
    """The last step a run was to reach: planned (`run.steps`), or where a clean stop ended it."""

    planned: int | None
    stopped_at: int | None

    def past(self, step: int) -> str | None:
        """Why `step` lies past the run's last step, or None."""
        if self.stopped_at is not None and step > self.stopped_at:
            return f"step {step} is past step {self.stopped_at}, where the run stopped"
        if self.planned is not None and step > self.planned:
            return f"step {step} is past the run's last step {self.planned} (run.steps)"
        return None


def _evaluate(gate: Gate, records: dict[int, dict[str, Any]], healthy: set[int], reach: _Reach) -> GateResult:
    first = gate.step if gate.stat == "at" else gate.first_step
    last = gate.step if gate.stat == "at" else gate.last_step
    values = [
        float(r[gate.metric])
        for step, r in records.items()
        if (first is None or step >= first)
        and (last is None or step <= last)
        and (not gate.healthy_only or step in healthy)
        and _number(r.get(gate.metric))
    ]
    op, bound = gate.bound
    symbol, compare = _BOUNDS[op]
    bound_text = f"{symbol} {bound:g}"
    result = partial(GateResult, gate=gate.name, metric=gate.metric, stat=gate.stat, bound=bound_text)
    # Train steps count from 1, evaluations from 0 (the baseline before training).
    reason = reach.past(first if first is not None else int(not per_evaluation(gate.metric)))
    if reason is not None:
        return result(value=None, passed=True, num_values=0, reason=reason, skipped=True)
    if not values:
        return result(value=None, passed=False, num_values=0, reason=_no_values(gate))
    value = _STATISTICS[gate.stat](values)
    return result(value=value, passed=compare(value, bound), num_values=len(values))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _no_values(gate: Gate) -> str:
    if gate.stat == "at":
        where = f"at step {gate.step}"
    elif gate.first_step is None and gate.last_step is None:
        where = "in any step"
    else:
        where = f"in steps {gate.first_step or 0}-{'' if gate.last_step is None else gate.last_step}"
    return f"no value of {gate.metric} {where}" + (" with no poisoned samples" if gate.healthy_only else "")


def describe(result: GateResult) -> str:
    """One line: `gate passed: median(x) = 1.0093 (needs < 1.02)`, or for a gate without a value
    `gate FAILED: at(x, step 50): no value of x at step 50 (needs < 1.02)`."""
    state = "skipped" if result.skipped else "passed" if result.passed else "FAILED"
    shown = f": {result.reason}" if result.value is None else f" = {result.value:.6g}"
    return f"gate {state}: {result.gate}{shown} (needs {result.bound})"


def give_verdict(
    run_dir: Path, gates: GatesSection, steps: int | None = None, stopped_at: int | None = None
) -> Verdict:
    """Evaluate `gates` on the run, write `run_dir/gates.json` and log a line per gate.

    A recipe without gates gets a passing verdict and no file.
    """
    verdict = evaluate_gates(run_dir, gates, steps=steps, stopped_at=stopped_at)
    if gates.checks:
        (run_dir / VERDICT_FILE).write_text(json.dumps(msgspec.to_builtins(verdict), indent=2) + "\n")
        for result in verdict.results:
            (log.info if result.passed else log.warning)("%s", describe(result))
    return verdict
