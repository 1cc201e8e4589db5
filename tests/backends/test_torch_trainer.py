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


def test_of_two_updates_only_the_second_minibatch_takes_a_forward_without_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first minibatch's pre-step logprobs are its own forward's (no update has run yet);
    only the later minibatches' are computed apart, before the first update (the pinned
    figures above check that they are the pre-step policy's)."""
    trainer = _trainer(micro_batch_samples=256, updates_per_step=2)
    forwards: list[tuple[int, bool]] = []
    logprobs = trainer.logprobs

    def counted(chunk, *, reference: bool = False):  # type: ignore[no-untyped-def]
        forwards.append((len(chunk.inputs.responses), torch.is_grad_enabled()))
        return logprobs(chunk, reference=reference)

    monkeypatch.setattr(trainer, "logprobs", counted)
    trainer._train_step(_groups())
    # Two minibatches of two groups of three (one micro-batch each): one forward without
    # gradients (the second minibatch, first), then each minibatch's forward for its update.
    assert forwards == [(6, False), (6, True), (6, True)]


def test_micro_batches_take_whole_groups_in_order_up_to_the_sample_cap() -> None:
    """Without a token budget, a micro-batch takes whole groups in the minibatch's order (no
    length bucketing: responses are packed at their own lengths, so none pads to another) and
    holds each of its groups' prompts once, owned by that group's samples."""
    trainer = _trainer(vocab_size=23, micro_batch_samples=4, updates_per_step=1)
    groups = [
        _group(g, (2, 3), [length - i for i in range(2 if length > 1 else 1)])
        for g, length in enumerate([9, 2, 7, 3, 8, 1])
    ]
    minibatch = [chunk.inputs for chunk in trainer.micro_batches(groups)]
    assert [[len(r) for r in chunk.responses] for chunk in minibatch] == [
        [9, 8, 2, 1],
        [7, 6, 3, 2],
        [8, 7, 1],
    ]
    for chunk in minibatch:
        assert len(chunk.prompts) == len(set(chunk.owner))


def test_micro_batches_keep_to_a_token_budget_of_unpadded_tokens() -> None:
    """With `micro_batch_tokens`, a micro-batch closes before its prompts (once each) plus its
    responses' own tokens (unpadded) would pass the budget; a group over it is split into runs
    of its samples (each beside its own prompt), and a sample over it alone still gets one."""
    trainer = _trainer(vocab_size=23, micro_batch_samples=256, micro_batch_tokens=30, updates_per_step=1)
    groups = [_group(g, (2,) * 3, [length, length]) for g, length in enumerate([2, 4, 5, 20])]
    minibatch = [chunk.inputs for chunk in trainer.micro_batches(groups)]
    # 3 + 2 + 2 = 7; + 3 + 4 + 4 = 18; + 3 + 5 + 5 = 31 > 30; 13; + 3 + 20 = 36 > 30; the 20s
    # alone: 3 + 40 > 30, so one run each.
    assert [[len(r) for r in chunk.responses] for chunk in minibatch] == [[2, 2, 4, 4], [5, 5], [20], [20]]
    assert [len(chunk.prompts) for chunk in minibatch] == [2, 1, 1, 1]


def test_under_a_token_budget_a_long_tailed_group_is_split_into_runs() -> None:
    """A group of short samples and one long one, over the budget together: its short samples
    make one run and the long one another, each computing the prompt; every sample is trained
    once, beside its own prompt."""
    trainer = _trainer(vocab_size=23, micro_batch_samples=256, micro_batch_tokens=40, updates_per_step=1)
    groups = [_group(0, (2, 3), [3, 3, 3, 30]), _group(1, (4,), [3, 4, 3, 4])]
    minibatch = [chunk.inputs for chunk in trainer.micro_batches(groups)]
    # 2 + 9 = 11; + 30 = 41 > 40: a run of 30 alone (32); + 1 + 14 > 40: group 1 alone.
    assert [[len(r) for r in chunk.responses] for chunk in minibatch] == [[3, 3, 3], [30], [3, 4, 3, 4]]
    assert [(chunk.prompts, chunk.owner) for chunk in minibatch] == [
        ([(2, 3)], [0, 0, 0]),
        ([(2, 3)], [0]),
        ([(4,)], [0, 0, 0, 0]),
    ]


def test_a_checkpoint_with_another_parameter_list_is_refused_in_one_line(tmp_path: Path) -> None:
    """A trainer.pt written before q/k/v and gate/up were fused holds one optimizer entry per
    projection: loading it must be a clear error, not a zip or optimizer traceback."""
    from backends.torch.state_file import load_state
    from pipeline.contracts.errors import RecipeError

    trainer = _trainer(micro_batch_samples=256, updates_per_step=1)
    trainer._train_step(_groups())
    trainer.save(tmp_path)
    state = load_state(tmp_path / "trainer.pt")
    state["optimizer"]["param_groups"][0]["params"].append(999)  # one more, as the unfused layout had
    torch.save(state, tmp_path / "trainer.pt")  # whole, as checkpoints of that time were written
    with pytest.raises(RecipeError) as error:
        _trainer(micro_batch_samples=256, updates_per_step=1).load(tmp_path)
    assert str(error.value) == (
        f"checkpoint {tmp_path}: its optimizer state holds 16 parameters, the model has 15 "
        "(checkpoints written before the fused q/k/v and gate/up projections do not resume; "
        "`python -m pipeline export` gives its model files for model.path)"
    )


def test_a_step_that_compiles_says_how_many_graphs_it_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """`train/compiled_graphs` is dynamo's count of the graphs compiled during the step: a step
    whose forward meets a function not compiled before counts it; the next step, finding it
    compiled, counts none. (A cheap compile, backend "eager", stands in for a layer's.)"""
    trainer = _trainer(micro_batch_samples=256, updates_per_step=1)

    def shifted(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    compiled = torch.compile(shifted, backend="eager")
    logprobs = trainer.logprobs

    def compiling(chunk, *, reference: bool = False):  # type: ignore[no-untyped-def]
        compiled(torch.zeros(3))
        return logprobs(chunk, reference=reference)

    monkeypatch.setattr(trainer, "logprobs", compiling)
    first = trainer._train_step(_groups())
    second = trainer._train_step(_groups())
    assert first["train/compiled_graphs"] >= 1
    assert second["train/compiled_graphs"] == 0
