"""Recipe section types: the base every section derives from, the bounded number types, and the
sections the engine itself owns (run, async_rl, checkpoint, watchdog, wandb, tensorboard).

Configs are frozen msgspec Structs that reject unknown fields; msgspec reports the field's path
in its errors, which `pipeline.recipe` turns into one line naming the recipe file.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]


class Section(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Base of every recipe section.

    msgspec passes `frozen` on to subclasses, but a type checker reads it from each class
    statement (PEP 681), so every section repeats `frozen=True`."""


class RunSection(Section, frozen=True):
    dir: str = "runs/quickstart"
    steps: PositiveInt = 100
    seed: int = 0
    stop_grace_s: PositiveFloat = 30.0
    progress: bool = True  # the live terminal view (plain lines when not a terminal)
    log_every_steps: PositiveInt = 10  # a plain progress line every N steps (and at each eval)
    plot: bool = False  # write run.dir/report.png at the end (needs matplotlib)


class AsyncRLSection(Section, frozen=True):
    max_lookahead_versions: NonNegativeInt = 1
    # After each stand-down, the engine holds no memory it reports; after each wake or refit it
    # serves exactly the trainer's weights (fingerprints compared by the gate).
    handoff_checks: bool = True


class CheckpointSection(Section, frozen=True):
    every_steps: NonNegativeInt = 0  # 0: only at the last step and on a clean stop
    keep_last: Annotated[int, msgspec.Meta(ge=2)] = 2
    resume: str = "auto"  # "auto", "never" or a checkpoint path


class WatchdogSection(Section, frozen=True):
    stall_s: PositiveFloat = 600.0
    fail: bool = False


class WandbSection(Section, frozen=True):
    enabled: bool = False
    project: str = "grpo-pipeline"
    name: str | None = None  # default: the run directory's name
    tags: tuple[str, ...] = ()
    # None leaves the mode to wandb, so WANDB_MODE (and `wandb offline`) still decide.
    mode: Literal["offline", "online", "disabled"] | None = None


class TensorBoardSection(Section, frozen=True):
    enabled: bool = False  # event files in run.dir/tensorboard (needs the tensorboard package)


class BenchLengths(Section, frozen=True):
    """`rollout.bench_lengths`: ln(length) ~ Normal(ln(median_tokens), sigma)."""

    distribution: Literal["lognormal"] = "lognormal"
    median_tokens: PositiveInt = 256
    sigma: PositiveFloat = 0.9

    def describe(self, max_new_tokens: int) -> dict[str, Any]:
        """The distribution and its parameters, as benchmark results record them."""
        return {**msgspec.to_builtins(self), "max_new_tokens": max_new_tokens}


# What the recipe's `train.backend` accepts; backends/registry.py maps each to its module.
BackendName = Literal["torch", "megatron"]
