"""Metric gates on run directories written here: each statistic, bound, selection and verdict."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

import pipeline
from pipeline.runner import StopRequest
from pipeline.shell.run import run_program
from pipeline.testing import FakeEngine, FakeTrainer
from stages.gates import Gate, GatesSection, describe, evaluate_gates, give_verdict
from stages.run_dir import stopped_at

# Five train steps; step 3 had poisoned samples, step 4 left its metric out (non-finite).
STEPS = [
    {"step": 1, "rollout/poisoned_samples": 0, "x": 4.0},
    {"step": 2, "rollout/poisoned_samples": 0, "x": 1.0},
    {"step": 3, "rollout/poisoned_samples": 2, "x": 100.0},
    {"step": 4, "rollout/poisoned_samples": 0},
    {"step": 5, "rollout/poisoned_samples": 0, "x": 2.0},
]
EVALS = [{"step": 0, "eval/reward": 0.1}, {"step": 5, "eval/reward": 0.9}]


def write_run(run_dir: Path, steps: list[dict[str, Any]], evals: list[dict[str, Any]] = EVALS) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    return run_dir


def gate(**fields: Any) -> Gate:
    """A gate on `x` (default: max < 1000)."""
    bound = {} if fields.keys() & {"lt", "le", "gt", "ge"} else {"lt": 1000.0}
    return msgspec.convert({"metric": "x", "stat": "max", **bound, **fields}, Gate)


def one(run_dir: Path, g: Gate) -> Any:
    (result,) = evaluate_gates(run_dir, GatesSection(checks=(g,))).results
    return result


@pytest.mark.parametrize(
    ("fields", "value"),
    [
        ({"stat": "median"}, 3.0),  # of 4, 1, 100, 2: step 4 has no value and is not a zero
        ({"stat": "mean"}, 26.75),
        ({"stat": "max"}, 100.0),
        ({"stat": "min"}, 1.0),
        ({"stat": "last"}, 2.0),
        ({"stat": "at", "step": 2}, 1.0),
        ({"stat": "max", "first_step": 4}, 2.0),
        ({"stat": "max", "last_step": 2}, 4.0),
        ({"stat": "mean", "first_step": 2, "last_step": 3}, 50.5),
        ({"stat": "max", "healthy_only": True}, 4.0),
        ({"stat": "median", "healthy_only": True}, 2.0),
        ({"metric": "eval/reward", "stat": "min"}, 0.1),
        ({"metric": "eval/reward", "stat": "at", "step": 0}, 0.1),
        ({"metric": "eval/reward", "stat": "last"}, 0.9),
    ],
    ids=lambda v: json.dumps(v) if isinstance(v, dict) else None,
)
def test_each_statistic_and_selection(tmp_path: Path, fields: dict[str, Any], value: float) -> None:
    result = one(write_run(tmp_path, STEPS), gate(**fields))
    assert result.value == value
    assert result.passed and result.reason is None


@pytest.mark.parametrize(
    ("bound", "passed"),
    [
        ({"lt": 2.0}, False),  # last is 2.0: strict bounds fail at equality
        ({"lt": 2.5}, True),
        ({"le": 2.0}, True),
        ({"le": 1.5}, False),
        ({"gt": 2.0}, False),
        ({"gt": 1.5}, True),
        ({"ge": 2.0}, True),
        ({"ge": 2.5}, False),
    ],
    ids=lambda v: json.dumps(v) if isinstance(v, dict) else None,
)
def test_each_bound(tmp_path: Path, bound: dict[str, float], passed: bool) -> None:
    g = msgspec.convert({"metric": "x", "stat": "last", **bound}, Gate)
    result = one(write_run(tmp_path, STEPS), g)
    assert (result.value, result.passed) == (2.0, passed)
    (op,) = bound
    assert result.bound == {"lt": "<", "le": "<=", "gt": ">", "ge": ">="}[op] + f" {bound[op]:g}"


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"stat": "at", "step": 4}, "no value of x at step 4"),
        ({"stat": "at", "step": 9}, "no value of x at step 9"),
        ({"stat": "max", "first_step": 6}, "no value of x in steps 6-"),
        ({"stat": "max", "first_step": 3, "last_step": 4, "healthy_only": True},
         "no value of x in steps 3-4 with no poisoned samples"),
        ({"metric": "y", "stat": "mean"}, "no value of y in any step"),
        ({"metric": "eval/exact_match", "stat": "last"}, "no value of eval/exact_match in any step"),
    ],
)  # fmt: skip
def test_a_gate_without_values_fails_with_its_reason(
    tmp_path: Path, fields: dict[str, Any], reason: str
) -> None:
    result = one(write_run(tmp_path, STEPS), gate(**fields))
    assert (result.value, result.passed, result.num_values, result.reason) == (None, False, 0, reason)


def test_a_run_directory_without_files_fails_its_gates_without_crashing(tmp_path: Path) -> None:
    verdict = evaluate_gates(tmp_path, GatesSection(checks=(gate(), gate(metric="eval/reward"))))
    assert not verdict.passed
    assert [r.reason for r in verdict.results] == [
        "no value of x in any step",
        "no value of eval/reward in any step",
    ]


def test_of_repeated_steps_the_last_record_counts(tmp_path: Path) -> None:
    # A resumed run may repeat steps logged before its resume: the later record is the one kept.
    steps = [
        *STEPS[:3],
        {"step": 2, "rollout/poisoned_samples": 0, "x": 7.0},
        {"step": 3, "rollout/poisoned_samples": 0, "x": 5.0},
    ]
    run_dir = write_run(tmp_path, steps, [*EVALS, {"step": 5, "eval/reward": 0.2}])
    assert one(run_dir, gate(stat="at", step=2)).value == 7.0
    assert one(run_dir, gate(stat="mean")).value == pytest.approx((4.0 + 7.0 + 5.0) / 3)
    assert one(run_dir, gate(stat="last")).value == 5.0  # step order, not line order
    # Step 3's poisoned record was replaced by a healthy one.
    assert one(run_dir, gate(stat="max", healthy_only=True)).value == 7.0
    assert one(run_dir, gate(metric="eval/reward", stat="last")).value == 0.2


def test_a_line_cut_short_by_a_kill_is_skipped(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path, STEPS)
    with (run_dir / "metrics.jsonl").open("a") as file:
        file.write('{"step": 6, "x": 99')
    assert one(run_dir, gate(stat="last")).value == 2.0


def test_give_verdict_writes_gates_json_and_logs_a_line_per_gate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = write_run(tmp_path, STEPS)
    gates = GatesSection(
        checks=(gate(stat="median", healthy_only=True, lt=2.5), gate(stat="at", step=4, ge=0.5))
    )
    with caplog.at_level(logging.INFO, logger="stages.gates"):
        verdict = give_verdict(run_dir, gates)
    assert not verdict.passed
    assert json.loads((run_dir / "gates.json").read_text()) == {
        "passed": False,
        "results": [
            {
                "gate": "median(x, healthy)",
                "metric": "x",
                "stat": "median",
                "bound": "< 2.5",
                "value": 2.0,
                "passed": True,
                "num_values": 3,
                "reason": None,
                "skipped": False,
            },
            {
                "gate": "at(x, step 4)",
                "metric": "x",
                "stat": "at",
                "bound": ">= 0.5",
                "value": None,
                "passed": False,
                "num_values": 0,
                "reason": "no value of x at step 4",
                "skipped": False,
            },
        ],
    }
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "gate passed: median(x, healthy) = 2 (needs < 2.5)"),
        ("WARNING", "gate FAILED: at(x, step 4): no value of x at step 4 (needs >= 0.5)"),
    ]


def test_without_gates_the_verdict_passes_and_writes_nothing(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path, STEPS)
    assert give_verdict(run_dir, GatesSection()).passed
    assert not (run_dir / "gates.json").exists()


def test_gate_names_say_what_they_select() -> None:
    assert (
        gate(stat="median", first_step=2, last_step=4, healthy_only=True).name
        == "median(x, steps 2-4, healthy)"
    )
    assert gate(stat="min", first_step=100).name == "min(x, steps 100-)"
    assert gate(stat="max", last_step=9).name == "max(x, steps -9)"
    assert gate(stat="at", step=80).name == "at(x, step 80)"


def test_describe_a_failed_value() -> None:
    result = evaluate_gates(Path("/nonexistent"), GatesSection(checks=(gate(),))).results[0]
    assert (
        describe(msgspec.structs.replace(result, value=1.5, reason=None))
        == "gate FAILED: max(x) = 1.5 (needs < 1000)"
    )


def test_a_run_gives_its_verdict_on_a_clean_stop_and_at_its_end(tmp_path: Path) -> None:
    # The real wiring: run_program evaluates the recipe's gates and returns the verdict.
    recipe = pipeline.load_recipe(
        "recipes/quickstart.yaml",
        [
            f"run.dir={tmp_path / 'run'}",
            "run.progress=false",
            "run.plot=false",
            "run.steps=4",
            "eval.every_steps=0",
            "gates.checks=[{metric: step, stat: last, ge: 4}, {metric: step, stat: at, step: 4, ge: 4}]",
        ],
    )
    stop = StopRequest()

    def echo(record: dict[str, Any]) -> None:
        if record.get("step") == 1:
            stop.request("test stop")

    stopped = anyio.run(
        lambda: run_program(recipe, engine=FakeEngine(), trainer=FakeTrainer(), stop=stop, echo=echo)
    )
    assert stopped.stopped and stopped.steps_done < 4
    assert not stopped.passed
    # A gate over every step fails on the steps it reached; the one on step 4 is skipped.
    assert [(r.value, r.passed, r.skipped) for r in stopped.verdict.results] == [
        (stopped.steps_done, False, False),
        (None, True, True),
    ]
    assert json.loads((tmp_path / "run" / "gates.json").read_text())["passed"] is False
    # The stop is noted in the run directory, so `check` gives the verdict the run gave itself.
    assert stopped_at(tmp_path / "run") == stopped.steps_done
    assert stopped.verdict == evaluate_gates(
        tmp_path / "run", recipe.gates, steps=4, stopped_at=stopped_at(tmp_path / "run")
    )

    finished = anyio.run(lambda: run_program(recipe, engine=FakeEngine(), trainer=FakeTrainer()))
    assert (finished.stopped, finished.steps_done, finished.passed) == (False, 4, True)
    assert stopped_at(tmp_path / "run") is None  # the start that finished took the note back
    assert finished.verdict == evaluate_gates(tmp_path / "run", recipe.gates)
    assert json.loads((tmp_path / "run" / "gates.json").read_text())["passed"] is True


def test_a_gate_past_the_runs_planned_last_step_is_skipped_not_failed(tmp_path: Path) -> None:
    """A run shortened by an override (`run.steps=5` on a recipe gated at step 80) is not
    failed by gates it never planned to reach; a gate on steps it did plan still fails."""
    run_dir = write_run(tmp_path, STEPS)
    late = gate(stat="at", step=80, metric="eval/reward", ge=0.9)
    from_late = gate(first_step=6)
    failing = gate(lt=1.0)
    verdict = evaluate_gates(run_dir, GatesSection(checks=(late, from_late, failing)), steps=5)
    assert [(r.passed, r.skipped) for r in verdict.results] == [(True, True), (True, True), (False, False)]
    assert describe(verdict.results[0]) == (
        "gate skipped: at(eval/reward, step 80): step 80 is past the run's last step 5 "
        "(run.steps) (needs >= 0.9)"
    )
    assert verdict.summary() == "gates: 1 of 1 failed, 2 skipped"
    assert not verdict.passed
    alone = evaluate_gates(run_dir, GatesSection(checks=(late,)), steps=5)
    assert alone.passed and alone.summary() == "gates: all 0 passed, 1 skipped"
    assert not evaluate_gates(run_dir, GatesSection(checks=(late,))).passed  # no planned length given


def test_a_gate_past_the_step_where_the_run_stopped_is_skipped_not_failed(tmp_path: Path) -> None:
    """A clean stop at step 5 (run.steps 100): gates on later steps are skipped, those on the
    steps it ran are evaluated over them; a stop before any train step skips train-step gates."""
    run_dir = write_run(tmp_path, STEPS)
    late = gate(stat="at", step=80, metric="eval/reward", ge=0.9)
    whole = gate(lt=1000.0)
    verdict = evaluate_gates(run_dir, GatesSection(checks=(late, whole)), steps=100, stopped_at=5)
    assert [(r.passed, r.skipped) for r in verdict.results] == [(True, True), (True, False)]
    assert describe(verdict.results[0]) == (
        "gate skipped: at(eval/reward, step 80): step 80 is past step 5, where the run stopped (needs >= 0.9)"
    )
    assert verdict.passed and verdict.summary() == "gates: all 1 passed, 1 skipped"
    baseline = gate(metric="eval/reward", stat="min", gt=0.0)
    at_once = evaluate_gates(
        write_run(tmp_path / "none", [], EVALS[:1]), GatesSection(checks=(whole, baseline)), stopped_at=0
    )
    assert [(r.passed, r.skipped) for r in at_once.results] == [(True, True), (True, False)]
    assert at_once.results[0].reason == "step 1 is past step 0, where the run stopped"
