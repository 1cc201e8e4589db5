"""The root recipe: the engine's own sections composed with each stage's section."""

from __future__ import annotations

import msgspec

from backends.megatron.rules import check_engine
from backends.placement import LocalPlacement, Placement, check_placement
from backends.torch.config import ModelConfig
from backends.torch.section import ModelSection
from pipeline.contracts.sections import (
    AsyncRLSection,
    CheckpointSection,
    RunSection,
    Section,
    TensorBoardSection,
    WandbSection,
    WatchdogSection,
)
from pipeline.shell.backend_input import sampling_of
from pipeline.shell.metric_names import MetricNames, check_names
from stages.evaluation import EvalSection
from stages.faults import FaultsSection
from stages.gates import GatesSection
from stages.prompts import PromptsSection
from stages.reward import RewardSection
from stages.rollout import RolloutSection
from stages.train import TrainSection


def _default_model() -> ModelSection:
    return ModelSection(config=ModelConfig(vocab_size=16))


class Recipe(Section, frozen=True):
    run: RunSection = msgspec.field(default_factory=RunSection)
    async_rl: AsyncRLSection = msgspec.field(default_factory=AsyncRLSection)
    colocated: bool = True
    placement: Placement = msgspec.field(default_factory=LocalPlacement)
    checkpoint: CheckpointSection = msgspec.field(default_factory=CheckpointSection)
    watchdog: WatchdogSection = msgspec.field(default_factory=WatchdogSection)
    wandb: WandbSection = msgspec.field(default_factory=WandbSection)
    tensorboard: TensorBoardSection = msgspec.field(default_factory=TensorBoardSection)
    model: ModelSection = msgspec.field(default_factory=_default_model)
    prompts: PromptsSection = msgspec.field(default_factory=PromptsSection)
    rollout: RolloutSection = msgspec.field(default_factory=RolloutSection)
    reward: RewardSection = msgspec.field(default_factory=RewardSection)
    train: TrainSection = msgspec.field(default_factory=TrainSection)
    eval: EvalSection = msgspec.field(default_factory=EvalSection)
    faults: FaultsSection = msgspec.field(default_factory=FaultsSection)
    gates: GatesSection = msgspec.field(default_factory=GatesSection)

    def __post_init__(self) -> None:
        if self.rollout.partial and not self.colocated:
            raise ValueError(
                "rollout.partial: true needs colocated: true (a separate engine never stands "
                "down, so nothing would freeze); set rollout.partial: false"
            )
        rows, group = self.rollout.max_rows, self.rollout.samples_per_prompt
        if rows and rows < group:
            raise ValueError(
                f"rollout.max_rows: {rows} is below rollout.samples_per_prompt ({group}): a "
                f"group's samples are generated together; set rollout.max_rows >= {group}, or 0 for no cap"
            )
        if self.eval.every_steps and not self.prompts.source.num_heldout:
            raise ValueError(
                "eval.every_steps needs held-out prompts: set prompts.source.num_heldout > 0 "
                "or eval.every_steps: 0"
            )
        check_placement(
            self.placement,
            colocated=self.colocated,
            device=self.model.device,
            tensor_parallel=self.train.tensor_parallel,
            data_parallel=self.train.data_parallel,
            partial=self.rollout.partial,
            reward_function=self.reward.function,
            environment=self.rollout.environment,
        )
        check_engine(
            sampling_of(self),
            backend=self.train.backend,
            model=self.model,
            tensor_parallel=self.train.tensor_parallel,
        )
        check_names(self.gates, MetricNames.for_recipe(self))
