"""Each algorithm variant's loss and gradient through the one update loop, against a hand
computation in float64 (plain Python arithmetic, exact to 1e-12), on one group of three
responses of lengths 3, 1 and 2 whose ratios fall inside, below and above the clip range."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import pipeline
from pipeline.algorithms import advantages as estimators
from pipeline.algorithms.config import Algorithm, LossConfig
from pipeline.algorithms.presets import algorithm_of, resolve
from pipeline.algorithms.update import Chunk, run_update
from pipeline.contracts.errors import RecipeError
from pipeline.contracts.messages import TrainGroup, TrainSample
from stages.train import TrainSection

REWARDS = [1.0, 0.0, 0.5]
LENGTHS = [3, 1, 2]
MAX_NEW = 4
# log(ratio) per token: 0.1 (inside), -0.5 (below 1 - 0.2), 0.22 (above 1.2, below 1.28) ...
LOG_RATIO = [[0.1, -0.5, 0.22], [0.4], [-0.05, 0.3]]
LOG_OFF_POLICY = [[0.0, 1.2, -0.3], [0.9], [-1.0, 0.2]]  # old - gen: tis caps exp() at 2
LP = [[-0.5 - 0.1 * i - 0.07 * t for t in range(n)] for i, n in enumerate(LENGTHS)]


@pytest.fixture(autouse=True)
def _float64() -> Iterator[None]:
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


class OneChunk:
    """A backend whose policy logprobs are one leaf tensor: the loop's gradient lands on it."""

    device = torch.device("cpu")
    has_reference = False

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(0)
        width = max(LENGTHS)
        self.theta = torch.tensor([row + [0.0] * (width - len(row)) for row in LP], requires_grad=True)
        self.grad: torch.Tensor | None = None

    def micro_batches(self, groups: list[TrainGroup]) -> list[Chunk]:
        (group,) = groups
        chunk = Chunk.of(group.samples, None, self.device)
        # The pre-step logprobs: logprobs minus each token's log ratio.
        chunk.old = torch.tensor(
            [
                [lp - d for lp, d in zip(LP[i] + [0.0] * 3, LOG_RATIO[i] + [0.0] * 3, strict=False)][:3]
                for i in range(3)
            ]
        )
        return [chunk]

    def logprobs(self, chunk: Chunk, *, reference: bool = False) -> torch.Tensor:
        return self.theta * chunk.mask

    def zero_grad(self) -> None:
        self.theta.grad = None

    def apply(self, *, finite_loss: bool) -> float | None:
        assert self.theta.grad is not None
        self.grad = self.theta.grad.clone()
        return 1.0

    def lr(self) -> float:
        return 0.0


def group(advantages: list[float]) -> TrainGroup:
    gen = [[lp - LOG_RATIO[i][t] - LOG_OFF_POLICY[i][t] for t, lp in enumerate(LP[i])] for i in range(3)]
    return TrainGroup(
        group_id="0-0",
        prompt_tokens=(1,),
        samples=tuple(
            TrainSample(tokens=(2,) * n, logprobs=tuple(gen[i]), reward=REWARDS[i], advantage=advantages[i])
            for i, n in enumerate(LENGTHS)
        ),
    )


def run(algorithm: Algorithm, advantages: list[float]) -> tuple[float, list[list[float]]]:
    backend = OneChunk()
    metrics, skipped = run_update(backend, [group(advantages)], algorithm=algorithm, updates_per_step=1)
    assert skipped == 0 and backend.grad is not None
    return metrics["train/loss"], [backend.grad[i, :n].tolist() for i, n in enumerate(LENGTHS)]


def token_surrogate(a: float, log_ratio: float, config: LossConfig, off_policy: float) -> tuple[float, float]:
    """(loss, d loss / d logprob) of one token by hand: -min(r A, clip(r) A) x IS weight."""
    r = math.exp(log_ratio)
    low, high = 1 - config.clip_low, 1 + config.clip_high
    clipped = min(max(r, low), high)
    weight = 1.0
    if config.is_correction == "tis":
        weight = min(math.exp(off_policy), config.is_cap)
    elif config.is_correction == "icepop":
        weight = math.exp(off_policy) if 1 / config.is_cap <= math.exp(off_policy) <= config.is_cap else 0.0
    loss = -min(r * a, clipped * a) * weight
    active = low <= r <= high or r * a < clipped * a  # the unclipped branch carries the gradient
    return loss, (-a * r * weight if active else 0.0)


def hand_token_level(algorithm: Algorithm, adv: list[float]) -> tuple[float, list[list[float]]]:
    tokens, n = sum(LENGTHS), len(LENGTHS)
    weights = {
        "token_mean": lambda i: 1 / tokens,
        "sequence_mean": lambda i: 1 / (LENGTHS[i] * n),
        "token_sum": lambda i: 1 / (n * MAX_NEW),
    }[algorithm.loss_aggregation]
    loss, grads = 0.0, []
    for i in range(n):
        row = []
        for t in range(LENGTHS[i]):
            value, grad = token_surrogate(adv[i], LOG_RATIO[i][t], algorithm.loss, LOG_OFF_POLICY[i][t])
            loss += value * weights(i)
            row.append(grad * weights(i))
        grads.append(row)
    return loss, grads


def close(got: tuple[float, list[list[float]]], expected: tuple[float, list[list[float]]]) -> None:
    assert got[0] == pytest.approx(expected[0], abs=1e-12, rel=0)
    for got_row, row in zip(got[1], expected[1], strict=True):
        assert got_row == pytest.approx(row, abs=1e-12, rel=0)


def preset(name: str) -> Algorithm:
    return resolve(TrainSection(algorithm=name), max_response_tokens=MAX_NEW, samples_per_prompt=3)  # type: ignore[arg-type]


def test_advantage_estimators_by_hand() -> None:
    loo = [1.0 - 0.25, 0.0 - 0.75, 0.5 - 0.5]  # each reward minus the mean of the other two
    std = math.sqrt(((1 - 0.5) ** 2 + 0.5**2 + 0) / 3)
    assert estimators.rloo(REWARDS) == pytest.approx(loo, abs=1e-12)
    assert estimators.grpo(REWARDS) == pytest.approx([a / std for a in loo], abs=1e-12)
    assert estimators.dr_grpo(REWARDS) == pytest.approx([0.5, -0.5, 0.0], abs=1e-12)
    assert estimators.grpo([0.3, 0.3]) == [0.0, 0.0]  # no spread: nothing over a zero std
    # Equal rewards whose float mean is not their value (0.1 x 3 sums to 0.30000000000000004):
    # a std of 1e-17 from rounding would blow the rounding left in the advantages up to +-1.
    assert estimators.grpo([0.1, 0.1, 0.1]) == pytest.approx([0.0, 0.0, 0.0], abs=1e-12)
    assert estimators.grpo([1.0]) == estimators.rloo([1.0]) == estimators.dr_grpo([1.0]) == [0.0]


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "dapo"])
def test_token_level_variants_by_hand(name: str) -> None:
    algorithm = preset(name)
    adv = algorithm.advantages()(REWARDS)
    close(run(algorithm, adv), hand_token_level(algorithm, adv))


def test_the_presets_knobs() -> None:
    assert (preset("grpo").advantage, preset("grpo").loss_aggregation) == ("grpo", "token_mean")
    assert (preset("dr_grpo").advantage, preset("dr_grpo").loss_aggregation) == ("dr_grpo", "token_sum")
    assert preset("rloo").advantage == "rloo"
    dapo = preset("dapo")
    assert (dapo.dynamic_sampling, dapo.overlong_buffer, dapo.loss.clip_high) == (True, 1, 0.28)
    gspo = preset("gspo")
    assert (gspo.policy_loss, gspo.loss_aggregation, gspo.loss.clip_low) == (
        "sequence",
        "sequence_mean",
        3e-4,
    )
    # A knob set on its own beats the preset's.
    mixed = resolve(
        TrainSection(algorithm="gspo", clip_low=0.1), max_response_tokens=MAX_NEW, samples_per_prompt=3
    )
    assert (mixed.policy_loss, mixed.loss.clip_low) == ("sequence", 0.1)


def test_clip_higher_keeps_the_gradient_of_a_ratio_between_1_2_and_1_28() -> None:
    """DAPO's clip-higher: token (0, 2), ratio e^0.22 = 1.246 with A > 0, trains under
    clip_high 0.28 and is clipped (no gradient) under a symmetric 0.2."""
    algorithm = preset("dapo")
    adv = algorithm.advantages()(REWARDS)
    assert adv[0] > 0
    assert run(algorithm, adv)[1][0][2] != 0.0
    symmetric = replace(algorithm, loss=replace(algorithm.loss, clip_high=0.2))
    assert run(symmetric, adv)[1][0][2] == 0.0


@pytest.mark.parametrize("is_correction", ["none", "tis"])
def test_gspo_sequence_ratio_by_hand(is_correction: str) -> None:
    """One ratio a sequence, exp(mean log ratio), clipped per sequence; every token carries its
    sequence's loss (times its IS weight); sequence mean of token means."""
    gspo = preset("gspo")
    algorithm = replace(
        gspo, loss=replace(gspo.loss, clip_low=0.2, clip_high=0.28, is_correction=is_correction)
    )
    adv = algorithm.advantages()(REWARDS)
    n = len(LENGTHS)
    loss, grads = 0.0, []
    for i, length in enumerate(LENGTHS):
        s = math.exp(sum(LOG_RATIO[i]) / length)
        clipped = min(max(s, 0.8), 1.28)
        seq_loss = -min(s * adv[i], clipped * adv[i])
        active = 0.8 <= s <= 1.28 or s * adv[i] < clipped * adv[i]
        d_seq = -adv[i] * s / length if active else 0.0  # d seq_loss / d logprob of each token
        w = [min(math.exp(x), 2.0) if is_correction == "tis" else 1.0 for x in LOG_OFF_POLICY[i]]
        loss += sum(seq_loss * w_t for w_t in w) / (length * n)
        grads.append([sum(w) / (length * n) * d_seq] * length)
    close(run(algorithm, adv), (loss, grads))


def test_a_custom_loss_by_module_and_function() -> None:
    name = "tests.pipeline.algorithms.custom_loss:squared_advantage"
    algorithm = resolve(
        TrainSection(policy_loss=name, advantage="rloo"), max_response_tokens=MAX_NEW, samples_per_prompt=3
    )
    adv = algorithm.advantages()(REWARDS)
    tokens = sum(LENGTHS)
    loss = sum(-a * abs(a) * sum(LOG_RATIO[i]) / tokens for i, a in enumerate(adv))
    grads = [[-a * abs(a) / tokens] * LENGTHS[i] for i, a in enumerate(adv)]
    close(run(algorithm, adv), (loss, grads))


def test_the_overlong_penalty_by_hand() -> None:
    algorithm = Algorithm(overlong_buffer=4, overlong_penalty=0.5, max_response_tokens=10)
    assert [algorithm.overlong(n) for n in (1, 6, 7, 9, 10, 12)] == [0.0, 0.0, -0.125, -0.375, -0.5, -0.5]


def test_with_an_environment_the_response_budget_is_the_episodes() -> None:
    """An episode's response is everything after its prompt (the multi-turn recipe's
    rollout.max_episode_tokens: 16), not one turn (its max_new_tokens: 1): Dr. GRPO's token sum
    divides by it, DAPO's overlong buffer is a quarter of it and its penalty ends there."""
    multi_turn = "recipes/multi-turn-cpu.yaml"
    dapo = algorithm_of(pipeline.load_recipe(multi_turn, ["train.algorithm=dapo"]))
    assert (dapo.max_response_tokens, dapo.overlong_buffer) == (16, 4)
    assert [dapo.overlong(n) for n in (12, 14, 16)] == [0.0, -0.5, -1.0]
    dr_grpo = algorithm_of(pipeline.load_recipe(multi_turn, ["train.algorithm=dr_grpo"]))
    assert (dr_grpo.loss_aggregation, dr_grpo.max_response_tokens) == ("token_sum", 16)
    with pytest.raises(RecipeError) as error:
        algorithm_of(pipeline.load_recipe(multi_turn, ["train.overlong_buffer=16"]))
    assert str(error.value) == (
        "train.overlong_buffer: 16 must be below rollout.max_episode_tokens (16): the penalty would "
        "start before the first token"
    )


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            TrainSection(advantage="gae"),
            "train.advantage: unknown advantage estimator 'gae'; choose one of dr_grpo, grpo, rloo "
            "or name your own as module:function",
        ),
        (
            TrainSection(policy_loss="no_such_module_x:f"),
            "train.policy_loss: cannot import module 'no_such_module_x': No module named 'no_such_module_x'",
        ),
        (
            TrainSection(policy_loss="math:nope"),
            "train.policy_loss: module 'math' has no function 'nope'",
        ),
        (
            TrainSection(overlong_buffer=4),
            "train.overlong_buffer: 4 must be below rollout.max_new_tokens (4): the penalty would "
            "start before the first token",
        ),
    ],
)
def test_a_wrong_name_or_combination_is_one_recipe_error(section: TrainSection, message: str) -> None:
    with pytest.raises(RecipeError) as error:
        resolve(section, max_response_tokens=MAX_NEW, samples_per_prompt=3)
    assert str(error.value) == message


def test_a_loss_module_that_fails_as_it_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "exiting_loss.py").write_text("import sys\nsys.exit('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RecipeError) as error:
        resolve(TrainSection(policy_loss="exiting_loss:f"), max_response_tokens=MAX_NEW, samples_per_prompt=3)
    assert str(error.value) == (
        "train.policy_loss: cannot import module 'exiting_loss': SystemExit: no GPU here "
        f"({tmp_path / 'exiting_loss.py'}, line 2)"
    )


def test_dynamic_sampling_needs_groups() -> None:
    with pytest.raises(RecipeError, match=r"^train.dynamic_sampling needs rollout.samples_per_prompt >= 2"):
        resolve(TrainSection(algorithm="dapo"), max_response_tokens=MAX_NEW, samples_per_prompt=1)


def test_the_clip_fraction_counts_the_tokens_whose_ratio_left_the_range() -> None:
    """Ratios e^-0.5, e^0.4 and e^0.3 leave [0.8, 1.28]: 3 of the 6 tokens."""
    backend = OneChunk()
    algorithm = preset("grpo")
    metrics, _ = run_update(
        backend, [group(algorithm.advantages()(REWARDS))], algorithm=algorithm, updates_per_step=1
    )
    assert metrics["train/clip_fraction"] == 0.5


def test_icepop_by_hand() -> None:
    """icepop zeroes the tokens whose off-policy weight lies outside [1/cap, cap]."""
    grpo = preset("grpo")
    algorithm = replace(grpo, loss=replace(grpo.loss, is_correction="icepop"))
    adv = algorithm.advantages()(REWARDS)
    close(run(algorithm, adv), hand_token_level(algorithm, adv))


REFERENCE = [[-0.6, -0.4, -0.9], [-0.3], [-1.0, -0.5]]


class WithReference(OneChunk):
    has_reference = True

    def logprobs(self, chunk: Chunk, *, reference: bool = False) -> torch.Tensor:
        if reference:
            return torch.tensor([row + [0.0] * (3 - len(row)) for row in REFERENCE]) * chunk.mask
        return super().logprobs(chunk)


def test_the_reference_kl_by_hand() -> None:
    """kl_coef x k3, k3 = exp(ref - lp) - (ref - lp) - 1, added to each token's loss; its token
    mean is train/kl_ref."""
    grpo = preset("grpo")
    algorithm = replace(grpo, loss=replace(grpo.loss, kl_coef=0.1))
    adv = algorithm.advantages()(REWARDS)
    loss, grads = hand_token_level(algorithm, adv)
    tokens = sum(LENGTHS)
    kl_total = 0.0
    for i, row in enumerate(grads):
        for t in range(LENGTHS[i]):
            d = REFERENCE[i][t] - LP[i][t]
            kl_total += math.exp(d) - d - 1
            loss += 0.1 * (math.exp(d) - d - 1) / tokens
            row[t] += 0.1 * (1 - math.exp(d)) / tokens
    backend = WithReference()
    metrics, _ = run_update(backend, [group(adv)], algorithm=algorithm, updates_per_step=1)
    assert backend.grad is not None
    close(
        (metrics["train/loss"], [backend.grad[i, :n].tolist() for i, n in enumerate(LENGTHS)]), (loss, grads)
    )
    assert metrics["train/kl_ref"] == pytest.approx(kl_total / tokens, abs=1e-12)


class Poisoned(OneChunk):
    """A forward that gives NaN: the loss is not finite."""

    def logprobs(self, chunk: Chunk, *, reference: bool = False) -> torch.Tensor:
        return super().logprobs(chunk) * math.nan

    def apply(self, *, finite_loss: bool) -> float | None:
        assert not finite_loss
        return None


def test_a_non_finite_loss_skips_the_update_and_counts_it() -> None:
    algorithm = preset("grpo")
    metrics, skipped = run_update(
        Poisoned(), [group(algorithm.advantages()(REWARDS))], algorithm=algorithm, updates_per_step=1
    )
    assert skipped == 1 and metrics["train/applied_updates"] == 0.0
    assert math.isnan(metrics["train/grad_norm"])
