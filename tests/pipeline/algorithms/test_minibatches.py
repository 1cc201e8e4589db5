"""Several updates a step: every minibatch's ratio is against the pre-step policy, also the
minibatches that train after the step's first update has moved the weights."""

from __future__ import annotations

import pytest
import torch

from pipeline.algorithms.config import Algorithm
from pipeline.algorithms.update import Chunk, run_update
from pipeline.contracts.messages import TrainGroup, TrainSample


class Moving:
    """A backend whose every applied update raises each token's logprob by 1."""

    device = torch.device("cpu")
    has_reference = False

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(0)
        self.shift = 0.0
        self.theta = torch.zeros((), requires_grad=True)

    def micro_batches(self, groups: list[TrainGroup]) -> list[Chunk]:
        return [Chunk.of([s for g in groups for s in g.samples], None, self.device)]

    def logprobs(self, chunk: Chunk, *, reference: bool = False) -> torch.Tensor:
        return (chunk.gen + self.shift + self.theta) * chunk.mask

    def zero_grad(self) -> None:
        self.theta.grad = None

    def apply(self, *, finite_loss: bool) -> float | None:
        self.shift += 1.0
        return 1.0

    def lr(self) -> float:
        return 0.0


def test_a_later_minibatchs_ratio_is_against_the_weights_before_the_steps_first_update() -> None:
    groups = [
        TrainGroup(
            group_id=f"0-{g}",
            prompt_tokens=(1,),
            samples=(TrainSample(tokens=(2, 3), logprobs=(-1.0, -1.0), reward=1.0, advantage=1.0),),
        )
        for g in range(2)
    ]
    metrics, skipped = run_update(Moving(), groups, algorithm=Algorithm(), updates_per_step=2)
    # The first minibatch trains at the pre-step weights (ratio 1); the second one after the
    # first update, at ratio e against them: clipped, its 2 tokens of the step's 4.
    assert skipped == 0
    assert metrics["train/clip_fraction"] == pytest.approx(0.5)
