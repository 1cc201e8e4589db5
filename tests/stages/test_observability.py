"""What a real run shows: the metrics files' schema, the Chrome trace, wandb (offline) and
TensorBoard sinks, the plot and timeline commands, and the console view."""

from __future__ import annotations

import io
import json
import logging
import math
import re
import struct
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import anyio
import pytest

import pipeline
from pipeline.logs import reset_warnings, warn_once
from pipeline.metrics import REQUIRED_KEYS, read
from pipeline.shell.console import Console, ConsoleHandler
from pipeline.shell.run import run_program
from pipeline.testing import FakeEngine, FakeTime, FakeTrainer

# Every stage's time on the batch, and the time the trainer waited for it.
STAGE_TIMING_KEYS = {
    "timing/prompts_s",
    "timing/generate_s",
    "timing/reward_s",
    "timing/wait_s",
    "timing/train_s",
}
GATE_ORDER = {True: ["stand_down", "train", "wake"], False: ["train", "refit"]}
PNG = b"\x89PNG\r\n\x1a\n"


def run(run_dir: Path, *overrides: str) -> Path:
    recipe = pipeline.load_recipe(
        "recipes/quickstart.yaml",
        [f"run.dir={run_dir}", "run.progress=false", "run.plot=false", "eval.num_prompts=32", *overrides],
    )
    anyio.run(pipeline.run, recipe)
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    """A colocated L=1 run and a separate L=0 run of the real CPU backend, 5 steps each."""
    root = tmp_path_factory.mktemp("runs")
    common = ("run.steps=5", "eval.every_steps=2", "checkpoint.every_steps=2")
    return {
        True: run(root / "colocated", *common, "colocated=true", "async_rl.max_lookahead_versions=1"),
        False: run(root / "separate", *common, "colocated=false", "async_rl.max_lookahead_versions=0"),
    }


def strict_lines(path: Path) -> list[dict[str, Any]]:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in {path.name}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


# -- metrics.jsonl and eval.jsonl ------------------------------------------------------------


@pytest.mark.parametrize("colocated", [True, False], ids=["colocated", "separate"])
def test_every_metrics_line_has_the_design_keys_finite(runs: dict[bool, Path], colocated: bool) -> None:
    lines = strict_lines(runs[colocated] / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5]
    gate_keys = {f"timing/{name}_s" for name in GATE_ORDER[colocated]}
    for line in lines:
        missing = (REQUIRED_KEYS | STAGE_TIMING_KEYS | gate_keys) - set(line)
        assert not missing, f"step {line['step']} lacks {sorted(missing)}"
        for key, value in line.items():
            assert isinstance(value, int | float), (key, value)
            assert math.isfinite(value), (key, value)
        assert {"queue/batches", "queue/generated", "queue/scored"} <= set(line)
        hist = [line[f"rollout/lag_hist/{lag}"] for lag in range(2 if colocated else 1)]
        assert sum(hist) == pytest.approx(1.0)
        assert line["timing/save_s"] > 0 if line["step"] in (2, 4, 5) else "timing/save_s" not in line


def test_evaluations_go_to_eval_jsonl_with_the_baseline(runs: dict[bool, Path]) -> None:
    evals = strict_lines(runs[True] / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2, 4, 5]
    for record in evals:
        assert {"eval/reward", "eval/exact_match", "timing/eval_s", "policy_version"} <= set(record)
    assert not any("eval/reward" in line for line in read(runs[True] / "metrics.jsonl"))


# -- trace.json ------------------------------------------------------------------------------


def spans_by_track(trace: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    names = {
        e["tid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    tracks: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for event in trace["traceEvents"]:
        if event["ph"] == "X":
            tracks[names[event["tid"]]].append(event)
    return tracks


def assert_nested(spans: list[dict[str, Any]], track: str) -> None:
    """Chrome trace complete events on one thread must nest: no partial overlaps."""
    open_ends: list[float] = []
    for span in sorted(spans, key=lambda s: (s["ts"], -s["dur"])):
        while open_ends and open_ends[-1] <= span["ts"] + 1e-3:
            open_ends.pop()
        if open_ends:
            assert span["ts"] + span["dur"] <= open_ends[-1] + 1e-3, f"{track}: {span['name']} overlaps"
        open_ends.append(span["ts"] + span["dur"])


@pytest.mark.parametrize("colocated", [True, False], ids=["colocated", "separate"])
def test_trace_is_valid_chrome_json_whose_spans_nest(runs: dict[bool, Path], colocated: bool) -> None:
    trace = json.loads((runs[colocated] / "trace.json").read_text())
    assert trace["displayTimeUnit"] == "ms"
    for event in trace["traceEvents"]:
        assert {"name", "ph", "pid", "tid"} <= set(event)
        assert isinstance(event["tid"], int) and isinstance(event["pid"], int)
        if event["ph"] == "X":
            assert event["ts"] >= 0 and event["dur"] >= 0
        else:
            assert event["ph"] in ("M", "C")
    tracks = spans_by_track(trace)
    assert {"prompts", "train", "reward 0", "rollout 0"} <= set(tracks)
    for track, spans in tracks.items():
        assert_nested(spans, track)
    generated = [s for name, spans in tracks.items() if name.startswith("rollout ") for s in spans]
    assert len(generated) == 5 * 32  # one request per group, no retries
    assert sum(len(s) for name, s in tracks.items() if name.startswith("reward ")) == 5 * 32


@pytest.mark.parametrize("colocated", [True, False], ids=["colocated", "separate"])
def test_trace_counts_each_steps_idle_decode_slots_and_trainer_tokens(
    runs: dict[bool, Path], colocated: bool
) -> None:
    """The trace's counters show where a step's time goes: the decode loop's idle slots, its
    steps, mean width and time a step, and the tokens the trainer computed beside those it
    trained, one sample a step, as logged."""
    trace = json.loads((runs[colocated] / "trace.json").read_text())
    lines = strict_lines(runs[colocated] / "metrics.jsonl")

    def samples(name: str) -> list[dict[str, float]]:
        return [e["args"] for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == name]

    assert samples("decode slots") == [{"idle fraction": r["rollout/idle_slot_fraction"]} for r in lines]
    assert samples("decode steps") == [
        {
            "steps": r["rollout/decode_steps"],
            "mean width": r["rollout/decode_width"],
            "ms a step": r["timing/decode_step_ms"],
        }
        for r in lines
    ]
    assert samples("train tokens") == [
        {"trained": r["train/tokens"], "computed": r["train/computed_tokens"]} for r in lines
    ]


@pytest.mark.parametrize("colocated", [True, False], ids=["colocated", "separate"])
def test_each_step_logs_where_its_decode_loops_time_went(runs: dict[bool, Path], colocated: bool) -> None:
    """Beside the idle slots, each step's line splits the engine's decode loops' time since
    the step before: their steps and mean width, the prefills, the checks, and the rest as
    milliseconds a decode step; and the host's wait at the checks for the device (on the CPU
    nothing is queued, so a little of the loop: each check's read timed)."""
    lines = [r for r in strict_lines(runs[colocated] / "metrics.jsonl") if "rollout/idle_slot_fraction" in r]
    assert lines and lines[0]["step"] == 1
    for r in lines:
        steps, loop = r["rollout/decode_steps"], r["timing/loop_s"]
        prefill, check = r["timing/loop_prefill_s"], r["timing/loop_check_s"]
        assert steps >= 1 and r["rollout/decode_width"] >= 1
        assert prefill > 0 and check > 0 and loop > prefill + check
        assert r["timing/decode_step_ms"] == pytest.approx(1000 * (loop - prefill - check) / steps)
        assert 0 < r["timing/loop_wait_s"] < loop - prefill - check


@pytest.mark.parametrize("colocated", [True, False], ids=["colocated", "separate"])
def test_gate_spans_match_the_recorded_transitions(runs: dict[bool, Path], colocated: bool) -> None:
    train = spans_by_track(json.loads((runs[colocated] / "trace.json").read_text()))["train"]
    lines = {line["step"]: line for line in read(runs[colocated] / "metrics.jsonl")}
    steps = {int(s["name"].split()[1]): s for s in train if re.fullmatch(r"step \d+", s["name"])}
    assert sorted(steps) == [1, 2, 3, 4, 5]
    for step, outer in steps.items():
        inside = sorted(
            (s for s in train if s is not outer and outer["ts"] <= s["ts"] <= outer["ts"] + outer["dur"]),
            key=lambda s: s["ts"],
        )
        order = [s["name"] for s in inside]
        expected = list(GATE_ORDER[colocated])
        if "timing/save_s" in lines[step]:
            expected.insert(2, "save")  # after train (colocated: before the wake; else after the refit)
        assert order == expected, (step, order)
        for span in inside:
            assert span["dur"] / 1e6 == pytest.approx(lines[step][f"timing/{span['name']}_s"], abs=2e-6)


# -- sinks -----------------------------------------------------------------------------------


def wandb_records(where: Path) -> list[Any]:
    """The records of an offline run's .wandb file (a LevelDB-style log of protobuf records);
    `where` is a run directory with one wandb run, or a wandb offline-run directory."""
    import wandb
    from wandb.proto import wandb_internal_pb2

    # `finish` returns once the run has ended, not once wandb's service process has written all
    # of it: tearing the service down waits for that (once in a full suite, a run's file held
    # no run record yet when read).
    wandb.teardown()
    (path,) = [*where.glob("wandb/offline-run-*/run-*.wandb"), *where.glob("run-*.wandb")]
    data = path.read_bytes()
    block, position, pending, records = 32768, 7, b"", []
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def fake_run(run_dir: Path, *overrides: str) -> Path:
    """The quickstart recipe's run with a FakeEngine and a FakeTrainer on fake time: every line
    and evaluation as the recipe plans them, none lost to a deadline on a loaded machine."""
    recipe = pipeline.load_recipe(
        "recipes/quickstart.yaml",
        [f"run.dir={run_dir}", "run.progress=false", "run.plot=false", "eval.num_prompts=32", *overrides],
    )
    fake = FakeTime()

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(fake.autojump)
            engine, trainer = FakeEngine(time=fake), FakeTrainer(time=fake)
            await run_program(recipe, engine=engine, trainer=trainer, time_source=fake)
            tg.cancel_scope.cancel()

    anyio.run(main)
    return run_dir


@pytest.mark.timeout(1300)  # past wandb's own allowances below, twice
def test_wandb_offline_records_the_recipe_and_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What wandb records of a run (a fake backend on fake time: the run itself cannot be cut
    short by a loaded machine; only wandb's own process start takes wall time)."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # the recipe leaves the mode to the environment
    monkeypatch.setenv("WANDB_SILENT", "true")
    # wandb gives its service process 30 s to start and a run 90 s to begin: on a loaded machine
    # (load 6-40) both ran out. What is tested here is what it records, not how fast.
    monkeypatch.setenv("WANDB__SERVICE_WAIT", "600")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "600")
    run_dir = fake_run(
        tmp_path / "run", "run.steps=3", "eval.every_steps=2", "wandb.enabled=true", "wandb.tags=[ci, cpu]"
    )
    records = wandb_records(run_dir)
    (started,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert started.run_group == "run" and started.display_name == "run"
    assert list(started.tags) == ["ci", "cpu"]
    config = {item.key: json.loads(item.value_json) for item in started.config.update}
    assert config["run"]["steps"] == 3
    assert config["train"]["lr"] == 5.0e-4
    by_step: dict[int, dict[str, Any]] = defaultdict(dict)
    for r in records:
        if r.WhichOneof("record_type") == "history":
            key = lambda item: item.key or "/".join(item.nested_key)  # noqa: E731
            by_step[r.history.step.num].update({key(i): json.loads(i.value_json) for i in r.history.item})
    assert sorted(by_step) == [0, 1, 2, 3]  # the evaluation before training is step 0
    for line in read(run_dir / "metrics.jsonl"):
        logged = by_step[line["step"]]
        for key in ("reward/mean", "train/loss", "rollout/max_lag", "timing/step_s"):
            assert logged[key] == pytest.approx(line[key])
    assert "eval/reward" in by_step[0] and "eval/reward" in by_step[2]


def test_tensorboard_gets_every_scalar(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = run(tmp_path / "run", "run.steps=3", "eval.every_steps=0", "tensorboard.enabled=true")
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    lines = read(run_dir / "metrics.jsonl")
    assert [step for step, _ in losses] == [1, 2, 3]
    assert [value for _, value in losses] == pytest.approx([line["train/loss"] for line in lines], rel=1e-6)
    assert "timing/wake_s" in events.Tags()["scalars"]


def test_a_sink_that_is_not_installed_is_a_recipe_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    with pytest.raises(
        pipeline.RecipeError, match=r"wandb.enabled: wandb is not installed \(pip install wandb\)"
    ):
        run(tmp_path / "run", "run.steps=1", "eval.every_steps=0", "wandb.enabled=true")


# -- plot and timeline -----------------------------------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args], capture_output=True, text=True, timeout=600
    )


def test_plot_writes_a_png_for_one_run_and_for_two(runs: dict[bool, Path], tmp_path: Path) -> None:
    one = cli("plot", str(runs[True]))
    assert one.returncode == 0, one.stderr
    assert (runs[True] / "report.png").read_bytes().startswith(PNG)
    both = cli("plot", str(runs[True]), str(runs[False]), "--out", str(tmp_path / "both.png"))
    assert both.returncode == 0, both.stderr
    assert (tmp_path / "both.png").read_bytes().startswith(PNG)
    assert (tmp_path / "both.png").stat().st_size > 20_000


def test_timeline_writes_a_png_of_a_window_of_the_trace(runs: dict[bool, Path], tmp_path: Path) -> None:
    result = cli("timeline", str(runs[True]), "--steps", "2:3", "--out", str(tmp_path / "t.png"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "t.png").read_bytes().startswith(PNG)


def test_reports_leave_the_host_applications_matplotlib_alone(
    runs: dict[bool, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Embedded in another program, drawing a report must not switch its backend or register
    figures with its pyplot."""
    import matplotlib

    from pipeline.shell.plot import write_report
    from pipeline.shell.timeline import write_timeline

    monkeypatch.setitem(matplotlib.rcParams, "backend", "svg")  # the host's choice
    write_report([runs[True]], tmp_path / "r.png")
    write_timeline(runs[True], tmp_path / "t.png")
    assert matplotlib.rcParams["backend"] == "svg"
    assert (tmp_path / "r.png").read_bytes().startswith(PNG)
    assert (tmp_path / "t.png").read_bytes().startswith(PNG)


def test_plot_of_a_directory_that_is_not_a_run_is_a_one_line_error(tmp_path: Path) -> None:
    result = cli("plot", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {tmp_path}: no metrics.jsonl here (is it a run directory?)"
    ]


# -- console and logging ---------------------------------------------------------------------


def record(step: int, **extra: float) -> dict[str, Any]:
    return {"step": step, "reward/mean": 0.5, "train/loss": 0.01, "rollout/max_lag": 1, **extra}


def test_console_prints_plain_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    clock = iter(range(100))
    console = Console(20, stream=out, log_every=5, now=lambda: float(next(clock)))
    for step in range(1, 21):
        console.record(record(step, **{"queue/scored": 3}))
    console.evaluation({"step": 20, "eval/reward": 0.875})
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines[:-1]] == ["1/20", "5/20", "10/20", "15/20", "20/20"]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    assert "ETA 5s" in lines[3]  # one second per step, five steps left
    assert "queues scored 3" in lines[1]
    assert lines[-1] == "eval @ step 20  reward 0.875"


def test_console_on_a_terminal_redraws_a_status_line_under_the_log() -> None:
    out = io.StringIO()
    console = Console(10, stream=out, live=True, log_every=10, width=lambda: 200)
    console.record(record(2))
    console.observe({"gate": "down", "queues": {"batches": 1, "generated": 4}})
    handler = ConsoleHandler(console)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("test.console")
    logger.addHandler(handler)
    try:
        logger.warning("something happened")
        console.close()
        logger.warning("after the run")
    finally:
        logger.removeHandler(handler)
    text = out.getvalue()
    assert "gate down" in text and "queues batches 1 generated 4" in text
    # The log line is printed on a cleared line, then the status line comes back.
    assert "\r\x1b[2KWARNING something happened\n\r\x1b[2Kstep 2/10" in text
    # Closing clears the status line for good: a late record prints plainly.
    assert text.endswith("\r\x1b[2KWARNING after the run\n")


def test_the_status_line_fits_the_terminal_so_a_redraw_leaves_no_copy() -> None:
    out = io.StringIO()
    console = Console(40, stream=out, live=True, log_every=100, width=lambda: 40)
    for step in range(2, 6):
        console.record(record(step, **{"throughput/tokens_per_s_per_gpu": 12345.0, "timing/step_s": 0.25}))
        console.observe({"gate": "serving", "queues": {"batches": 2, "generated": 16, "scored": 8}})
    drawn = [part for part in out.getvalue().split("\r\x1b[2K") if part]
    assert drawn and all(len(part) <= 39 and "\n" not in part for part in drawn)
    assert drawn[-1] == "step 5/40  reward 0.500  loss +0.0100"  # whole fields only


def test_permanent_lines_wrap_between_fields_within_the_width() -> None:
    out = io.StringIO()
    console = Console(1000, stream=out, log_every=1, now=lambda: 0.0, width=lambda: 60)
    figures = {"throughput/tokens_per_s_per_gpu": 1234567.0, "timing/step_s": 0.25, "queue/scored": 3}
    console.record(record(1000, **figures))
    console.line("INFO    stages.gates: gate passed: at(eval/reward, step 80) = 0.998046875 (needs >= 0.9)")
    assert out.getvalue().splitlines() == [
        "step 1000/1000  reward 0.500  loss +0.0100  lag 1",
        "    tok/s 1,234,567  s/step 0.250  queues scored 3",
        "INFO    stages.gates: gate passed: at(eval/reward, step 80)",
        "    = 0.998046875 (needs >= 0.9)",
    ]


def test_start_up_narration_prints_as_its_time_and_message() -> None:
    out = io.StringIO()
    handler = ConsoleHandler(Console(10, stream=out, live=False, width=lambda: 80))
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    for name, level, message in (
        ("pipeline.startup", logging.INFO, "loading torch"),
        ("x", logging.WARNING, "careful"),
    ):
        handler.emit(logging.LogRecord(name, level, __file__, 1, message, None, None))
    narrated, other = out.getvalue().splitlines()
    assert re.fullmatch(r"\d\d:\d\d:\d\d loading torch", narrated)
    assert other == "WARNING careful"


def test_the_eta_follows_the_recent_steps_not_the_slow_first_ones() -> None:
    out = io.StringIO()
    times = iter([0.0, 30.0, 60.0, *(60.0 + i for i in range(1, 9))])  # two 30 s steps, then 1 s
    console = Console(20, stream=out, log_every=10, now=lambda: next(times))
    for step in range(1, 11):
        console.record(record(step))
    assert console.eta_s() == 10.0  # ten steps left at one second each


def test_debug_logging_is_ours_not_third_party_chatter() -> None:
    from pipeline.logs import setup

    stream = io.StringIO()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        setup("debug", logging.StreamHandler(stream))
        logging.getLogger("matplotlib.font_manager").debug("findfont: scoring DejaVu Sans")
        logging.getLogger("stages.program").debug("building the backend")
        logging.getLogger("matplotlib").info("a library's info")
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert [line.split(" ", 1)[1] for line in stream.getvalue().splitlines()] == [
        "DEBUG   stages.program: building the backend",
        "INFO    matplotlib: a library's info",
    ]


def test_warn_once_says_a_repeated_warning_once(caplog: pytest.LogCaptureFixture) -> None:
    reset_warnings()
    logger = logging.getLogger("test.once")
    with caplog.at_level(logging.DEBUG, logger="test.once"):
        for attempt in range(3):
            warn_once(logger, "engine", "engine failed (attempt %d)", attempt)
        warn_once(logger, "other", "another kind")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["engine failed (attempt 0)", "another kind"]
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 2


def test_log_level_flag_filters_records(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(f"run:\n  steps: 1\n  dir: {tmp_path / 'run'}\n")
    quiet = cli("validate", str(path), "--log-level", "error")
    assert quiet.returncode == 0 and quiet.stderr == ""
    bad = cli("validate", str(path), "--log-level", "loud")
    assert bad.returncode == 2 and "--log-level" in bad.stderr


def test_a_long_trace_keeps_its_most_recent_events() -> None:
    from pipeline.trace import Trace

    clock = iter(range(10_000))
    trace = Trace(lambda: float(next(clock)), max_events=100)
    for i in range(1000):
        trace.span(f"s{i}", float(i), float(i) + 0.5, track="train")
    snapshot = trace.snapshot()
    spans = [e for e in snapshot["traceEvents"] if e["ph"] == "X"]
    assert len(spans) <= 100 and spans[-1]["name"] == "s999"
    assert snapshot["otherData"]["dropped_events"] == 1000 - len(spans)
    assert [e["args"]["name"] for e in snapshot["traceEvents"] if e["name"] == "thread_name"] == ["train"]


def test_on_resume_the_sinks_drop_what_the_interrupted_run_logged_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sinks = (
        "tensorboard.enabled=true",
        "wandb.enabled=true",
        "eval.every_steps=0",
        "checkpoint.every_steps=2",
    )
    run_dir = run(tmp_path / "run", "run.steps=3", *sinks)
    shutil.rmtree(run_dir / "checkpoints" / "step-000003")  # as if killed after step 3's line
    run(run_dir, "run.steps=4", *sinks)  # resumes from step 2
    lines = read(run_dir / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("train/loss")
    assert [e.step for e in scalars] == [1, 2, 3, 4]  # the stale step 3 is purged, not repeated
    losses = {e.step: e.value for e in scalars}
    assert losses[3] == pytest.approx(lines[2]["train/loss"], rel=1e-6)  # the resumed run's
    started = [
        next(r.run for r in wandb_records(d) if r.WhichOneof("record_type") == "run")
        for d in (run_dir / "wandb").glob("offline-run-*")
    ]
    assert [r.run_group for r in started] == ["run", "run"]
    assert sorted((r.display_name, "resumed" in r.tags) for r in started) == [
        ("run", False),
        ("run-from-2", True),
    ]


def test_quiet_silences_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_SILENT", raising=False)
    args = ["run", "recipes/quickstart.yaml", "--quiet", f"run.dir={tmp_path / 'run'}", "run.steps=1"]
    args += ["eval.every_steps=0", "run.plot=false", "prompts.prompts_per_step=2", "wandb.enabled=true"]
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", *args], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert "wandb:" not in result.stdout + result.stderr  # its lines start so
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))  # it did log
