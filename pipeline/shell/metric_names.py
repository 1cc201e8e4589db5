"""The metric names a run logs, so a recipe's gates are checked before anything runs.

`MetricNames.for_recipe(recipe)` gives the names of `metrics.jsonl` (one record per train step)
and of `eval.jsonl` (one per held-out evaluation). Fixed names are those some configuration of
this pipeline writes (a gate on one this recipe never writes, such as `timing/refit_s` when
colocated, fails at the end with "no values"). Two families depend on the recipe:

- `rollout/lag_hist/<k>` for k = 0 .. async_rl.max_lookahead_versions (or run.steps, if fewer:
  no sample lags more versions than the run has steps);
- a reward's info keys, logged as `reward/<key>` on steps and `eval/<key>` on evaluations: for a
  built-in reward its own keys; for a `module:function` reward, whose keys are known only once it
  has run, any `reward/<key>` and `eval/<key>` (one path segment) is accepted.

`tests/pipeline/shell/test_metric_names.py` runs the pipeline and fails if it logs a name not known here
(or if a name known here is never logged).
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

import msgspec

from backends.placement import RayPlacement
from backends.ray.counters import PLACEMENT_COUNTERS
from pipeline.algorithms.presets import knob
from pipeline.metrics import REQUIRED_KEYS
from stages.step_record import lag_buckets

if TYPE_CHECKING:
    from pipeline.shell.recipe import Recipe
    from stages.gates import GatesSection

# What stages/train.py writes on each step besides the required keys.
_TRAIN_STAGE = (
    "batch",
    "reward/std",
    "reward/flat_groups",
    "rollout/dropped_groups",
    "rollout/unscored_samples",
    "rollout/mean_lag",
    "rollout/samples",
    "rollout/response_len",
    "rollout/response_len_p50",
    "rollout/response_len_p90",
    "rollout/response_len_max",
    "rollout/partial_samples",
    "rollout/reprefilled_tokens",
    "timing/wait_s",
    "train/empty_batches",
    # stages/checkpoint_writer.py: a saving step's wait for the previous write, and the
    # background writes finished since the last step
    "timing/save_wait_s",
    "timing/save_write_s",
)
# Seconds per batch from stages/timings.py (admission, rollout, reward) and from the engine
# gate's transitions (pipeline/gate.py), each logged as timing/<name>_s.
_TIMINGS = ("prompts", "generate", "reward", "stand_down", "train", "save", "wake", "refit")
_QUEUES = ("batches", "generated", "scored")  # the channels stages/wiring.py builds
# The run's running counts (stages/wiring.py's counters) and the metrics log's own marks.
_COUNTERS = (
    "rollout/retries",
    "rollout/engine_errors",
    "rollout/dropped_groups_total",
    "rollout/poisoned_samples_total",
    "reward/failures",
    "metrics/nonfinite_dropped",
    "metrics/recovered",
    "eval/skipped",  # evaluations skipped so far: a count on train steps, not an evaluation's figure
    "rollout/idle_slot_fraction",  # since the last step, from an engine with `statistics()`
    # and its decode loops' time since the last step (stages/wiring.py's decode_figures)
    "rollout/decode_steps",
    "rollout/decode_width",
    "timing/decode_step_ms",
    "timing/loop_s",
    "timing/loop_prefill_s",
    "timing/loop_check_s",
    "timing/loop_wait_s",
)
# backends/torch/trainer.py's train_step (the mismatch figures are required keys); kl_ref with
# train.kl_coef > 0, the offload figures with train.offload_optimizer.
_TRAINER = (
    "train/clip_fraction",
    "train/lr",
    "train/skipped_steps",
    "train/applied_updates",
    "train/tokens",
    "train/computed_tokens",
    "train/compiled_graphs",
    "train/kl_ref",
    "train/offloaded_gb",
    "timing/optimizer_reload_s",
    "timing/optimizer_offload_s",
)
# The info keys of the built-in environments (pipeline/environments/).
_BUILTIN_ENVIRONMENT_INFO: dict[str, tuple[str, ...]] = {
    "pipeline.environments.guess:GuessNumber": ("success", "guesses"),
}
# stages/step_record.py's multi-turn figures and the run's env/failures (rollout.environment).
_ENVIRONMENT = (
    "env/turns_mean",
    "env/turns_max",
    "env/truncated",
    "env/step_s",
    "env/reprefilled_tokens",
    "env/failures",
)
_DYNAMIC_SAMPLING = ("rollout/filtered_groups", "rollout/surplus_groups")  # stages/train.py's dynamic_sample
_EVAL = ("step", "policy_version", "eval/reward", "timing/eval_s")  # stages/train.py's evaluations
# The info keys of the built-in rewards (stages/reward.py, pipeline/rewards/math.py).
_BUILTIN_INFO: dict[str, tuple[str, ...]] = {"positional": ("exact_match",), "math": ("has_answer",)}


class MetricNames(msgspec.Struct, frozen=True, kw_only=True):
    steps: frozenset[str]  # metrics.jsonl
    evals: frozenset[str]  # eval.jsonl
    open_info: bool  # any reward/<key> and eval/<key> may appear (a module:function reward)

    @classmethod
    def for_recipe(cls, recipe: Recipe) -> MetricNames:
        # With an environment, its episodes' rewards replace reward.function's (and its keys).
        environment = recipe.rollout.environment
        if environment is not None:
            info = _BUILTIN_ENVIRONMENT_INFO.get(environment, ())
        else:
            info = _BUILTIN_INFO.get(recipe.reward.function, ())
        steps = {
            *REQUIRED_KEYS,
            *_TRAIN_STAGE,
            *(f"timing/{name}_s" for name in _TIMINGS),
            *(f"queue/{name}" for name in _QUEUES),
            *_COUNTERS,
            *(PLACEMENT_COUNTERS if isinstance(recipe.placement, RayPlacement) else ()),
            *_TRAINER,
            *(
                f"rollout/lag_hist/{k}"
                for k in range(lag_buckets(recipe.async_rl.max_lookahead_versions, recipe.run.steps))
            ),
            *(f"reward/{key}" for key in info),
            *(_DYNAMIC_SAMPLING if knob(recipe.train, "dynamic_sampling") else ()),
            *(_ENVIRONMENT if recipe.rollout.environment else ()),
        }
        evals = {*_EVAL, *(f"eval/{key}" for key in info)}
        # A user's environment's info keys, as a module:function reward's, are known once it has run.
        if environment is not None:
            open_info = environment not in _BUILTIN_ENVIRONMENT_INFO
        else:
            open_info = ":" in recipe.reward.function
        return cls(steps=frozenset(steps), evals=frozenset(evals), open_info=open_info)

    def known(self, name: str) -> bool:
        if name in self.steps or name in self.evals:
            return True
        prefix, _, key = name.partition("/")
        return self.open_info and prefix in ("reward", "eval") and bool(key) and "/" not in key

    def all(self) -> list[str]:
        return sorted(self.steps | self.evals)


def check_names(gates: GatesSection, names: MetricNames) -> None:
    """Raise ValueError naming the first gate whose metric no run of this recipe logs."""
    for i, gate in enumerate(gates.checks):
        if not names.known(gate.metric):
            close = difflib.get_close_matches(gate.metric, names.all(), n=1, cutoff=0.75)
            hint = f" (did you mean `{close[0]}`?)" if close else ""
            raise ValueError(
                f"gates.checks[{i}]: unknown metric `{gate.metric}`{hint}; "
                "the names a run logs are listed in README.md, 'Watching a run'"
            )
