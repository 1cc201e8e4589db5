"""The step record's lag figures against the samples each step trained on: `rollout/max_lag`,
`rollout/mean_lag` and `rollout/lag_hist/*` count, for every usable sample, the weights version
the engine served when the step began (the gate's) minus the version of the sample's first
token. Runs the real pipeline on fakes (a FakeEngine, a FakeTrainer, fake time), as
tests/stages/test_flow.py does, and recomputes each line's figures from the scored groups.
A recorder given a group with a poisoned and an unscored sample counts neither in its figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from statistics import fmean
from typing import Any

import pytest

from pipeline.clock import DeadlineClock
from pipeline.contracts.messages import Group, Prompt, Sample, TrainGroup
from pipeline.metrics import MetricsLog
from pipeline.testing import FakeEngine, FakeTime, FakeTrainer
from pipeline.trace import Trace
from pipeline.watchdog import Watchdog
from stages.context import RunContext
from stages.step_record import StepRecorder
from stages.timings import BatchTimings
from tests.stages.test_flow import drive, make_recipe, merge, metrics

PROMPT = Prompt(prompt_id="p0", text="1", tokens=(1,), answer="1")

CASES = {
    # Trains while the engine serves; requests of uneven latency, so a step's samples span lags.
    "separate-L2": dict(
        lookahead=2,
        engine=dict(blocks_training=False, latency=lambda call: (1.0, 7.0, 3.0)[call % 3]),
        sections={},
    ),
    "colocated-L1": dict(
        lookahead=1,
        engine=dict(blocks_training=True, latency=lambda call: (2.0, 9.0)[call % 2]),
        sections={},
    ),
    # Partial rollouts: a continued sample's lag counts its first token's version.
    "partial-L1": dict(
        lookahead=1,
        engine=dict(
            blocks_training=True,
            latency=lambda call: 40.0 if call // 2 % 2 else 8.0,
            partial_rollouts=True,
        ),
        sections={"rollout": {"partial": True}},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_each_lines_lag_is_the_gates_version_at_the_step_minus_each_samples_first_version(
    tmp_path: Path, scored: dict[str, Group], case: str
) -> None:
    """Catches a lag taken against another version (the step's number, the version after the
    step, a sample's last token's) or over other samples than the step's."""
    spec = CASES[case]
    fake = FakeTime()
    trained: list[tuple[int, list[Sample]]] = []

    def on_step(version: int, groups: Sequence[TrainGroup]) -> None:
        # The FakeTrainer's count of steps before this one: the version the engine serves.
        trained.append((version, [s for g in groups for s in scored[g.group_id].samples if s.usable]))

    recipe = make_recipe(tmp_path, steps=6, lookahead=spec["lookahead"], **merge(spec["sections"], {}))
    engine = FakeEngine(time=fake, response_len=4, **spec["engine"])
    await drive(recipe, engine, FakeTrainer(time=fake, latency=20.0, on_step=on_step), fake)
    lines = metrics(recipe)
    assert len(lines) == len(trained) == 6
    all_lags = []
    for line, (version, samples) in zip(lines, trained, strict=True):
        lags = [version - s.gen_version[0] for s in samples]
        all_lags += lags
        assert line["rollout/max_lag"] == max(lags), line["step"]
        assert line["rollout/mean_lag"] == pytest.approx(fmean(lags)), line["step"]
        hist = {int(k.rsplit("/", 1)[1]): v for k, v in line.items() if k.startswith("rollout/lag_hist/")}
        assert hist == {
            lag: pytest.approx(lags.count(lag) / len(lags)) for lag in range(spec["lookahead"] + 1)
        }, line["step"]
    # The runs exercise the figures: lags of more than one value, up to the bound.
    assert len(set(all_lags)) > 1 and max(all_lags) == spec["lookahead"]
    if case == "partial-L1":
        assert engine.frozen > 0


def test_a_lookahead_past_the_runs_steps_sizes_the_lag_histogram_by_the_steps() -> None:
    """No lag can exceed run.steps, so a huge L (accepted: it only means 'never wait') must not
    size anything: the histogram has buckets 0 .. min(L, steps)."""
    from stages.step_record import lag_buckets

    assert [lag_buckets(10**12, 3), lag_buckets(2, 3)] == [4, 3]


def test_a_step_records_only_its_usable_samples(tmp_path: Path) -> None:
    """A trained group's poisoned sample and its unscored one (no reward) are not trained on, so
    no figure of `trained` counts them: not the samples, the lengths nor the lags."""
    fake = FakeTime()
    context = RunContext(
        clock=DeadlineClock(source=fake),
        trace=Trace(fake.now),
        watchdog=Watchdog(fake, stall_s=1e9, fail=False),
        timings=BatchTimings(),
        metrics=MetricsLog(tmp_path),
    )
    recorder = StepRecorder(context, max_lag=3, counters=dict, queues=dict)

    def sample(index: int, length: int, version: int, **kind: Any) -> Sample:
        return Sample(
            prompt_id="p0",
            group_id="3-0",
            sample_index=index,
            target_step=3,
            gen_version=(version, version),
            tokens=(1,) * length,
            logprobs=(-1.0,) * length,
            finish_reason="stop",
            **kind,
        )

    usable = sample(0, 2, version=2, reward=1.0)
    poisoned = sample(1, 6, version=0, poisoned=True)
    unscored = sample(2, 10, version=0)
    group = Group(prompt=PROMPT, group_id="3-0", target_step=3, samples=(usable, poisoned, unscored))
    try:
        record = recorder.trained(3, [group], version=3)
    finally:
        context.metrics.close()
    assert (record["rollout/samples"], record["rollout/response_len"]) == (1, 2.0)
    assert (record["rollout/max_lag"], record["rollout/mean_lag"]) == (1, 1.0)
