"""The step record: one train step's metrics line, built before and after the step.

`rollout(batch, groups, dropped, version)` gives what the batch itself says (drops, poisoned and
unscored samples, rewards, lag against the engine's `version`, response lengths and their
percentiles, partial rollouts, groups whose rewards are all equal); `finish`
adds, once the step's weights are published, the gate's and the stages' timings, the step's
seconds (from the previous step's end, evaluations not charged), throughput, queue depths and
the run's counters. Metric names are listed in `pipeline.shell.metric_names`.

A group whose samples all got the same reward has advantage 0 everywhere and teaches nothing; a
run where that holds for every group, step after step, trains at loss 0 and looks healthy. After
`FLAT_STEPS_WARNING` steps in a row with no group's rewards spread, the recorder warns once,
naming what to check.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from statistics import fmean
from typing import Any

from pipeline.algorithms.advantages import population_std
from pipeline.contracts.messages import Dropped, EpisodeStats, Group, Sample
from pipeline.logs import warn_once
from stages.context import RunContext

log = logging.getLogger(__name__)

# Long enough that a hard task's first all-zero steps pass quietly, short enough to say it
# before a run has spent much of its time learning nothing.
FLAT_STEPS_WARNING = 10


def lag_buckets(lookahead: int, steps: int) -> int:
    """The buckets of `rollout/lag_hist/<k>`: lags 0 .. min(L, run.steps). A larger L admits no
    more than run.steps batches, so a recipe's L never sizes anything past its run."""
    return min(lookahead, steps) + 1


class StepRecorder:
    def __init__(
        self,
        context: RunContext,
        *,
        max_lag: int,
        counters: Callable[[], dict[str, float]],
        queues: Callable[[], dict[str, int]],
    ) -> None:
        self.context = context
        self.max_lag = max_lag
        self.counters = counters
        self.queues = queues
        self.last_step_end = context.clock.source.now()
        self._response_tokens = 0  # of the batch being trained
        self._stage_timings: dict[str, float] = {}
        self._flat_in_row = 0  # steps in a row whose every group had equal rewards

    def rollout(self, batch: int, groups: Sequence[Group], dropped: Sequence[Dropped]) -> dict[str, Any]:
        """The batch's own counts (its line's first fields, and an empty batch's warning); takes
        the stages' timings of the batch."""
        self._stage_timings = self.context.timings.pop(batch)
        return {
            "batch": batch,
            "rollout/dropped_groups": len(dropped),
            "rollout/poisoned_samples": sum(s.poisoned for g in groups for s in g.samples),
            "rollout/unscored_samples": sum(
                not s.poisoned and s.reward is None for g in groups for s in g.samples
            ),
        }

    def trained(self, step: int, groups: Sequence[Group], version: int) -> dict[str, Any]:
        """What the step trains on: rewards, reward parts, lag against `version`, lengths."""
        samples = [s for g in groups for s in g.samples if s.usable]
        rewards = [s.reward for s in samples if s.reward is not None]
        lags = [version - s.gen_version[0] for s in samples]
        self._response_tokens = sum(len(s.tokens) for s in samples)
        flat = self._flat_groups(step, groups)
        return {
            "step": step,
            "reward/mean": fmean(rewards),
            "reward/std": population_std(rewards),
            "reward/flat_groups": flat,
            **_info_means(samples),
            "rollout/max_lag": max(lags),
            "rollout/mean_lag": fmean(lags),
            **{
                f"rollout/lag_hist/{lag}": sum(x == lag for x in lags) / len(lags)
                for lag in range(max(self.max_lag, *lags) + 1)
            },
            "rollout/samples": len(samples),
            "rollout/response_len": self._response_tokens / len(samples),
            **_length_figures(samples),
            # Partial rollouts: samples continued after a stand-down, and what that re-prefilled.
            "rollout/partial_samples": sum(s.reprefilled_tokens > 0 for s in samples),
            "rollout/reprefilled_tokens": sum(s.reprefilled_tokens for s in samples),
            **_episode_figures([s.episode for g in groups for s in g.samples if s.episode is not None]),
        }

    def _flat_groups(self, step: int, groups: Sequence[Group]) -> int:
        """How many of the trained groups had one reward for all their samples; warns once when
        every group was so for `FLAT_STEPS_WARNING` steps in a row."""
        spreads = [
            max(rewards) > min(rewards)
            for rewards in (
                [s.reward for s in g.samples if not s.poisoned and s.reward is not None] for g in groups
            )
            if rewards
        ]
        flat = spreads.count(False)
        self._flat_in_row = 0 if any(spreads) else self._flat_in_row + 1
        if self._flat_in_row == FLAT_STEPS_WARNING:
            warn_once(
                log,
                "flat rewards",
                "steps %d-%d learned nothing: in every group all samples got the same reward, so "
                "every advantage was 0 (train/loss 0). Check that reward.function scores different "
                "answers differently (a constant, or a parse that always fails?) and that samples "
                "differ (rollout.temperature > 0, rollout.samples_per_prompt > 1); "
                "reward/flat_groups counts such groups each step",
                step - FLAT_STEPS_WARNING + 1,
                step,
            )
        return flat

    def finish(
        self,
        record: dict[str, Any],
        *,
        end: float,
        gate: Mapping[str, float],
        wait_s: float,
        **figures: Any,
    ) -> None:
        """Add the step's timings (`gate`: the gate's transitions; `wait_s`: waiting for the
        batch), throughput, queue depths, `figures` and the counters."""
        step_s = end - self.last_step_end
        self.last_step_end = end
        queue_depths = {f"queue/{name}": float(depth) for name, depth in self.queues().items()}
        tokens = self._response_tokens
        record.update(
            {
                **self._stage_timings,
                "timing/wait_s": wait_s,
                **{f"timing/{name}_s": seconds for name, seconds in gate.items()},
                "timing/step_s": step_s,
                "throughput/tokens_per_s_per_gpu": tokens / step_s if step_s > 0 else math.nan,
                **queue_depths,
                **figures,
                **self.counters(),
            }
        )
        trace = self.context.trace
        trace.counters("queues", queue_depths)
        trace.counters("lag", {"mean": record["rollout/mean_lag"], "max": record["rollout/max_lag"]})
        # Where a long tail's time goes: the decode loop's slots left idle since the last step,
        # its steps, their mean width and time, and what the trainer's passes computed beside
        # the responses' own tokens.
        if "rollout/idle_slot_fraction" in record:
            trace.counters("decode slots", {"idle fraction": record["rollout/idle_slot_fraction"]})
        if "rollout/decode_steps" in record:
            trace.counters(
                "decode steps",
                {
                    "steps": record["rollout/decode_steps"],
                    "mean width": record["rollout/decode_width"],
                    "ms a step": record["timing/decode_step_ms"],
                },
            )
        if "train/computed_tokens" in record:
            trace.counters(
                "train tokens",
                {"trained": record["train/tokens"], "computed": record["train/computed_tokens"]},
            )


def _length_figures(samples: Sequence[Sample]) -> dict[str, float]:
    """Response-length percentiles (nearest rank) and maximum, in tokens."""
    lengths = sorted(len(s.tokens) for s in samples)

    def rank(q: float) -> int:
        return lengths[max(0, math.ceil(q * len(lengths)) - 1)]

    return {
        "rollout/response_len_p50": rank(0.5),
        "rollout/response_len_p90": rank(0.9),
        "rollout/response_len_max": lengths[-1],
    }


def _episode_figures(episodes: Sequence[EpisodeStats]) -> dict[str, float]:
    """Multi-turn figures over every episode of the step's groups (failed ones included): turns,
    episodes truncated by a limit, wall seconds per environment call, and the context tokens
    prefilled again for turns after the first. None for single-turn samples."""
    if not episodes:
        return {}
    calls = sum(e.env_calls for e in episodes)
    return {
        "env/turns_mean": fmean(e.turns for e in episodes),
        "env/turns_max": max(e.turns for e in episodes),
        "env/truncated": sum(e.truncated for e in episodes),
        "env/step_s": sum(e.env_s for e in episodes) / calls if calls else 0.0,
        "env/reprefilled_tokens": sum(e.reprefilled_tokens for e in episodes),
    }


def _info_means(samples: Sequence[Sample]) -> dict[str, float]:
    keys = {key for s in samples for key in s.reward_info}
    return {f"reward/{key}": fmean(s.reward_info.get(key, 0.0) for s in samples) for key in sorted(keys)}
