"""The torch trainer's step on groups: micro-batching, and figures pinned from before groups
crossed the trainer boundary (tests/backends/trainer_steps.json: each step's metrics as the
trainer computed them from flattened samples, regrouped by group id)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from backends.torch.config import ModelConfig
from backends.torch.model import Decoder
from backends.torch.trainer import TorchTrainer
from pipeline.algorithms.config import Algorithm, LossConfig
from pipeline.contracts.messages import TrainGroup, TrainSample
from tests.backends.trainer_inputs import batching, optimizer

PINNED = json.loads((Path(__file__).parent / "trainer_steps.json").read_text())
OPTIONS = {
    "one": {"micro_batch_samples": 256, "updates_per_step": 1},
    "micro": {"micro_batch_samples": 4, "updates_per_step": 2},
    "tokens": {"micro_batch_samples": 256, "micro_batch_tokens": 20, "updates_per_step": 1},
}


def _trainer(*, vocab_size: int = 16, **options: int) -> TorchTrainer:
    torch.manual_seed(0)
    model = Decoder(
        ModelConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    )
    return TorchTrainer(
        model,
        algorithm=Algorithm(
            loss=LossConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.0, is_correction="tis", is_cap=2.0)
        ),
        optimizer=optimizer(),
        batching=batching(**options),
        temperature=1.0,
        seed=3,
    )


def _groups() -> list[TrainGroup]:
    """Four groups of three with uneven prompts and responses (the pinned figures' input)."""
    lengths = [[3, 5, 2], [4, 4, 1], [6, 2, 3], [1, 5, 5]]
    return [
        TrainGroup(
            group_id=f"0-{g}",
            prompt_tokens=(1, 2 + g, 3, 4)[: 2 + g % 3],
            samples=tuple(
                TrainSample(
                    tokens=tuple((5 + g + i + j) % 16 for j in range(n)),
                    logprobs=tuple(-1.5 - 0.1 * j - 0.05 * i for j in range(n)),
                    reward=0.0,
                    advantage=[1.0, -0.5, -0.5][i] * (1 + 0.1 * g),
                )
                for i, n in enumerate(group)
            ),
        )
        for g, group in enumerate(lengths)
    ]


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_a_step_on_groups_computes_the_figures_it_computed_on_flat_samples(name: str) -> None:
    """Catches a regrouping that pairs a response with another group's prompt or advantage, or
    that changes the shuffle, the micro-batch split or the token mean."""
    trainer = _trainer(**OPTIONS[name])
    for pinned in PINNED[name]:
        got = trainer._train_step(_groups())
        assert got.keys() == pinned.keys()
        # rel: the same arithmetic; only a fused kernel's rounding may differ.
        assert got == pytest.approx(pinned, rel=1e-5), name


def _group(g: int, prompt: tuple[int, ...], lengths: list[int]) -> TrainGroup:
    return TrainGroup(
        group_id=f"0-{g}",
        prompt_tokens=prompt,
        samples=tuple(
            TrainSample(tokens=(5,) * n, logprobs=(-2.0,) * n, reward=0.0, advantage=0.0) for n in lengths
        ),
    )


def test_micro_batches_bucket_groups_by_response_length() -> None:
    """One update's micro-batches take groups in order of their longest response, so a
    micro-batch pads short responses only to similar lengths."""
    trainer = _trainer(vocab_size=23, micro_batch_samples=4, updates_per_step=1)
    groups = [
        _group(g, (2, 3), [length - i for i in range(2 if length > 1 else 1)])
        for g, length in enumerate([9, 2, 7, 3, 8, 1])
    ]
    minibatch = [chunk.inputs for chunk in trainer.micro_batches(groups)]
    assert [max(len(r) for r in chunk.responses) for chunk in minibatch] == [2, 7, 9]
    assert sorted(len(r) for chunk in minibatch for r in chunk.responses) == sorted(
        len(s.tokens) for g in groups for s in g.samples
    )
    # Each micro-batch holds each of its groups' prompts once, owned by that group's samples.
    for chunk in minibatch:
        assert len(chunk.prompts) == len(set(chunk.owner))


def test_micro_batches_keep_to_a_token_budget() -> None:
    """With `micro_batch_tokens`, a micro-batch closes before its prompts (once each) and
    padded responses would pass the budget; a sample over it alone still gets one."""
    trainer = _trainer(vocab_size=23, micro_batch_samples=256, micro_batch_tokens=30, updates_per_step=1)
    groups = [_group(g, (2,) * 3, [length, length]) for g, length in enumerate([2, 4, 5, 20])]
    minibatch = [chunk.inputs for chunk in trainer.micro_batches(groups)]
    # lengths 2, 2, 4, 4: 2 x 3 + 4 x 4 = 22; adding a 5: 3 x 3 + 5 x 5 = 34 > 30; the 5s:
    # 3 + 2 x 5 = 13; a 20: 3 + 20 = 23, both 20s 3 + 40 > 30 (they share a prompt).
    assert [[len(r) for r in chunk.responses] for chunk in minibatch] == [[2, 2, 4, 4], [5, 5], [20], [20]]
    assert [len(chunk.prompts) for chunk in minibatch] == [2, 1, 1, 1]


def test_under_a_token_budget_a_long_tailed_group_is_split_by_length() -> None:
    """A group of short samples and one long one: under a token budget its short samples go
    with the other groups' short ones (each micro-batch computing their prompts once) and the
    long one alone, instead of all four padding to the long one; every sample trained once,
    beside its own prompt."""
    trainer = _trainer(vocab_size=23, micro_batch_samples=256, micro_batch_tokens=40, updates_per_step=1)
    groups = [_group(0, (2, 3), [3, 3, 3, 30]), _group(1, (4,), [3, 4, 3, 4])]
    minibatch = [chunk.inputs for chunk in trainer.micro_batches(groups)]
    assert [[len(r) for r in chunk.responses] for chunk in minibatch] == [[3, 3, 3, 3, 3, 4, 4], [30]]
    first, second = minibatch
    assert first.prompts == [(2, 3), (4,)] and first.owner == [0, 0, 0, 1, 1, 1, 1]
    assert second.prompts == [(2, 3)] and second.owner == [0]


def test_a_checkpoint_with_another_parameter_list_is_refused_in_one_line(tmp_path: Path) -> None:
    """A trainer.pt written before q/k/v and gate/up were fused holds one optimizer entry per
    projection: loading it must be a clear error, not a zip or optimizer traceback."""
    from pipeline.contracts.errors import RecipeError

    trainer = _trainer(micro_batch_samples=256, updates_per_step=1)
    trainer._train_step(_groups())
    trainer.save(tmp_path)
    state = torch.load(tmp_path / "trainer.pt", weights_only=False)
    state["optimizer"]["param_groups"][0]["params"].append(999)  # one more, as the unfused layout had
    torch.save(state, tmp_path / "trainer.pt")
    with pytest.raises(RecipeError) as error:
        _trainer(micro_batch_samples=256, updates_per_step=1).load(tmp_path)
    assert str(error.value) == (
        f"checkpoint {tmp_path}: its optimizer state holds 16 parameters, the model has 15 "
        "(checkpoints written before the fused q/k/v and gate/up projections do not resume; "
        "`python -m pipeline export` gives its model files for model.path)"
    )
