"""What one trainer update does with its inputs, pinned through the trainers' public step
(`train_step` / `_train_step` on groups) against a hand computation, for every backend's
trainer: the importance-sampling correction (`tis` caps the off-policy weight exp(old - gen) at
`is_cap`, `icepop` zeroes tokens whose weight is outside [1/cap, cap]) and the skip of an update
whose loss or gradient norm is not finite (the weights stay bit-identical and
`train/skipped_steps` counts it).

The groups' behaviour logprobs are set off the trainer's own by chosen amounts, so each token's
weight is known. With one update a step the trainer's ratio exp(logprobs - old) is 1 at its
forward, so the step's `train/loss` is -sum(A * w) / tokens and its gradient that of
-sum(A * w * logprobs) / tokens, both computed here on a copy of the model. Adam's first step
moves each weight by about lr * sign(gradient) whatever the gradient's scale, so the weights
alone would say little about w: the loss and the gradient norm carry it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

import pytest
import torch

from backends.torch.model import Decoder, token_logprobs
from backends.torch.trainer import TorchTrainer
from pipeline.algorithms.config import Algorithm, LossConfig
from pipeline.contracts.messages import TrainGroup, TrainSample
from tests.backends.megatron_cases import CONFIGS
from tests.backends.trainer_inputs import batching, optimizer

CONFIG = CONFIGS["llama"]
CAP = 2.0
LR = 1e-3
# Behaviour logprob = the trainer's minus this, per sample (token j of sample s adds 0.01 * j):
# weights exp(offset) about e^5 (over the cap), e^-5 (under 1/cap), e^0.3 and e^-0.3 (inside).
OFFSETS = [5.0, -5.0, 0.3, -0.3]
ADVANTAGES = [1.0, -0.5, 0.75, -1.25]


def _model() -> Decoder:
    torch.manual_seed(0)
    return Decoder(CONFIG)


def _algorithm(correction: str, policy_loss: str = "token") -> Algorithm:
    """GRPO's token loss (or `policy_loss`) and token-mean aggregation with this correction."""
    return Algorithm(
        loss=LossConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.0, is_correction=correction, is_cap=CAP),
        policy_loss=policy_loss,
    )


# A loss that is infinite while its gradient is finite: only the loss says skip.
INFINITE_LOSS = "tests.pipeline.algorithms.custom_loss:infinite_constant"


def _torch_trainer(
    model: Decoder,
    correction: str,
    *,
    grad_clip: float = 1.0,
    warmup_steps: int = 0,
    policy_loss: str = "token",
) -> TorchTrainer:
    return TorchTrainer(
        model,
        algorithm=_algorithm(correction, policy_loss),
        optimizer=optimizer(lr=LR, grad_clip=grad_clip, warmup_steps=warmup_steps),
        batching=batching(),
        temperature=1.0,
        seed=3,
    )


def _logprobs(model: Decoder, prompt: Sequence[int], response: Sequence[int]) -> torch.Tensor:
    """log p(response[j] | prompt, response[:j]) [R], from one plain forward (temperature 1)."""
    ids = torch.tensor([list(prompt) + list(response)])
    return token_logprobs(model, ids, torch.ones_like(ids))[0, len(prompt) - 1 :]


def _prompts() -> list[tuple[tuple[int, ...], list[tuple[int, ...]]]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for gi in range(2):
        prompt = tuple(torch.randint(0, CONFIG.vocab_size, (3 + gi,), generator=g).tolist())
        responses = [
            tuple(torch.randint(0, CONFIG.vocab_size, (2 + (s + gi) % 3,), generator=g).tolist())
            for s in range(len(OFFSETS))
        ]
        out.append((prompt, responses))
    return out


def _groups(model: Decoder, gen: Callable[[int, torch.Tensor], list[float]]) -> list[TrainGroup]:
    """Two groups of four samples whose behaviour logprobs are `gen(sample, trainer's)`."""
    with torch.no_grad():
        return [
            TrainGroup(
                group_id=f"0-{gi}",
                prompt_tokens=prompt,
                samples=tuple(
                    TrainSample(
                        tokens=response,
                        logprobs=tuple(gen(s, _logprobs(model, prompt, response))),
                        reward=0.0,
                        advantage=ADVANTAGES[s],
                    )
                    for s, response in enumerate(responses)
                ),
            )
            for gi, (prompt, responses) in enumerate(_prompts())
        ]


def _off_policy(s: int, trainer: torch.Tensor) -> list[float]:
    return [float(x) - OFFSETS[s] - 0.01 * j for j, x in enumerate(trainer)]


def _weight(correction: str, raw: float) -> float:
    if correction == "tis":
        return min(raw, CAP)
    if correction == "icepop":
        return raw if 1.0 / CAP <= raw <= CAP else 0.0
    return 1.0


def _by_hand(model: Decoder, groups: list[TrainGroup], correction: str) -> tuple[float, torch.Tensor, dict]:
    """(the step's loss a token, its gradient norm, each parameter's gradient) of one update."""
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    tokens = sum(len(s.tokens) for g in groups for s in g.samples)
    total = torch.zeros(())
    loss = 0.0
    for group in groups:
        for sample in group.samples:
            lp = _logprobs(model, group.prompt_tokens, sample.tokens)
            for j, gen in enumerate(sample.logprobs):
                w = _weight(correction, math.exp(float(lp[j].detach()) - gen))
                loss += -sample.advantage * w
                total = total - sample.advantage * w * lp[j]
    (total / tokens).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    return loss / tokens, norm, grads


_HAND: dict[str, tuple[float, torch.Tensor, dict]] = {}


def _hand(correction: str) -> tuple[float, torch.Tensor, dict]:
    """`_by_hand` on the test model and its off-policy groups, computed once per correction."""
    if correction not in _HAND:
        model = _model()
        _HAND[correction] = _by_hand(model, _groups(model, _off_policy), correction)
    return _HAND[correction]


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# -- the torch trainer ----------------------------------------------------------------------


@pytest.mark.parametrize("correction", ["tis", "icepop", "none"])
def test_the_torch_update_weighs_each_token_by_its_corrected_off_policy_weight(correction: str) -> None:
    """Catches a correction that is not applied, a cap not applied (tis), tokens outside
    [1/cap, cap] kept (icepop), or a weight that is not exp(old - gen)."""
    model = _model()
    groups = _groups(model, _off_policy)
    loss, norm, grads = _hand(correction)
    trainer = _torch_trainer(model, correction, grad_clip=1e9)  # no clipping: the raw gradient stays
    before = _params(model)
    got = trainer._train_step(groups)
    trainer.close()
    assert (got["train/skipped_steps"], got["train/applied_updates"]) == (0.0, 1.0)
    assert not torch.equal(model.lm_head.weight, before["lm_head.weight"])
    assert got["train/loss"] == pytest.approx(loss, rel=1e-5)
    assert got["train/grad_norm"] == pytest.approx(float(norm), rel=1e-4)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], rtol=1e-4, atol=1e-7, msg=name)


def test_the_corrections_differ_where_the_figures_say() -> None:
    """The hand computation's own check: on these groups the three corrections give three
    different losses and gradient norms (so the test above tells them apart)."""
    figures = [_hand(c)[:2] for c in ("tis", "icepop", "none")]
    assert len({round(loss, 6) for loss, _ in figures}) == 3
    assert len({round(float(norm), 6) for _, norm in figures}) == 3


def _nan_gen(s: int, trainer: torch.Tensor) -> list[float]:
    gen = _off_policy(s, trainer)
    return [math.nan, *gen[1:]] if s == 2 else gen


def _huge_advantages(groups: list[TrainGroup], advantage: float) -> list[TrainGroup]:
    return [
        TrainGroup(
            group_id=g.group_id,
            prompt_tokens=g.prompt_tokens,
            samples=tuple(
                TrainSample(tokens=s.tokens, logprobs=s.logprobs, reward=0.0, advantage=sign * advantage)
                for sign, s in zip([1, -1, 1, -1], g.samples, strict=True)
            ),
        )
        for g in groups
    ]


NONFINITE = {
    # A NaN behaviour logprob: its weight, the loss and the gradient are NaN.
    "nan-gen": lambda model: _groups(model, _nan_gen),
    # Advantages so large that the loss's sum overflows to inf.
    "inf-loss": lambda model: _huge_advantages(_groups(model, _off_policy), 3.0e38),
    # A finite loss whose gradient norm overflows (its squares pass float32's range).
    "inf-grad-norm": lambda model: _huge_advantages(_groups(model, _off_policy), 1.0e30),
}


# Under a warmup (LR/2 at the first update, LR at the second) a skipped update that moved the
# schedule would train the next step at another rate than a fresh trainer's first; with torch it
# would also warn (an error here) that the scheduler stepped before the optimizer.
@pytest.mark.parametrize("case", sorted(NONFINITE))
def test_a_torch_update_with_a_nonfinite_loss_or_gradient_is_skipped(case: str) -> None:
    """The weights stay bit-identical, the step counts the skip and applies no update; the next
    step on finite groups trains as a fresh trainer's first (no gradient, optimizer state or
    schedule position of the skipped one is carried into it)."""
    model = _model()
    bad = NONFINITE[case](model)
    trainer = _torch_trainer(model, "tis", warmup_steps=2)
    before = _params(model)
    got = trainer._train_step(bad)
    assert (got["train/skipped_steps"], got["train/applied_updates"]) == (1.0, 0.0)
    assert got["train/lr"] == LR / 2  # the schedule did not move: still the first update's rate
    if case == "inf-grad-norm":
        assert math.isfinite(got["train/loss"])  # the gradient norm alone says skip
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
    # The next step is the same as a fresh trainer's first.
    good = _groups(model, _off_policy)
    fresh_model = copy.deepcopy(model)
    fresh = _torch_trainer(fresh_model, "tis", warmup_steps=2)
    after, expected = trainer._train_step(good), fresh._train_step(good)
    trainer.close()
    fresh.close()
    assert (after["train/skipped_steps"], after["train/applied_updates"]) == (1.0, 1.0)
    assert after["train/lr"] == expected["train/lr"] == LR  # the second update's rate, both
    # (The skipped step moved the shuffle, so the sums may add up in another order.)
    assert after["train/loss"] == pytest.approx(expected["train/loss"], rel=1e-6)
    for (name, a), b in zip(model.named_parameters(), fresh_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_a_torch_update_whose_loss_alone_is_not_finite_is_skipped() -> None:
    model = _model()
    trainer = _torch_trainer(model, "tis", policy_loss=INFINITE_LOSS)
    before = _params(model)
    got = trainer._train_step(_groups(model, _off_policy))
    trainer.close()
    assert (got["train/skipped_steps"], got["train/applied_updates"]) == (1.0, 0.0)
    assert not math.isfinite(got["train/loss"])
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name


# -- the megatron trainer -------------------------------------------------------------------


@pytest.fixture
def megatron_trainer() -> Callable[..., object]:
    """Builds a `MegatronTrainer` (one rank, on the CPU) holding `model`'s weights."""
    pytest.importorskip("megatron.core")
    from backends.megatron import layout, parallel
    from backends.megatron.model import build_gpt_model
    from backends.megatron.optimizer import TorchAdamW
    from backends.megatron.trainer import MegatronTrainer

    cpu = torch.device("cpu")
    parallel.initialise(device=cpu)
    made = []

    def build(
        model: Decoder,
        correction: str,
        *,
        grad_clip: float = 1.0,
        warmup_steps: int = 0,
        policy_loss: str = "token",
    ) -> MegatronTrainer:
        gpt = build_gpt_model(CONFIG, dtype=torch.float32, device=cpu)
        layout.load_hf(gpt, model.state_dict(), CONFIG)
        step = TorchAdamW(gpt, lr=LR, betas=(0.9, 0.999), weight_decay=0.0, grad_clip=grad_clip)
        trainer = MegatronTrainer(
            gpt,
            step,
            config=CONFIG,
            algorithm=_algorithm(correction, policy_loss),
            optimizer=optimizer(lr=LR, grad_clip=grad_clip, warmup_steps=warmup_steps),
            batching=batching(),
            temperature=1.0,
            seed=3,
        )
        made.append(trainer)
        return trainer

    yield build
    for trainer in made:
        trainer.close()


@pytest.mark.parametrize("correction", ["tis", "icepop", "none"])
def test_the_megatron_update_weighs_each_token_by_its_corrected_off_policy_weight(
    correction: str, megatron_trainer: Callable[..., object]
) -> None:
    model = _model()
    groups = _groups(model, _off_policy)
    loss, norm, _ = _hand(correction)
    trainer = megatron_trainer(model, correction, grad_clip=1e9)
    got = trainer._train_step(groups)
    assert (got["train/skipped_steps"], got["train/applied_updates"]) == (0.0, 1.0)
    assert got["train/loss"] == pytest.approx(loss, rel=1e-5)
    assert got["train/grad_norm"] == pytest.approx(float(norm), rel=1e-4)


@pytest.mark.parametrize("case", sorted(NONFINITE))
def test_a_megatron_update_with_a_nonfinite_loss_or_gradient_is_skipped(
    case: str, megatron_trainer: Callable[..., object]
) -> None:
    model = _model()
    trainer = megatron_trainer(model, "tis", warmup_steps=2)  # the schedule moves: see the torch test
    before = _params(trainer.model)
    got = trainer._train_step(NONFINITE[case](model))
    assert (got["train/skipped_steps"], got["train/applied_updates"]) == (1.0, 0.0)
    assert got["train/lr"] == LR / 2  # the schedule did not move: still the first update's rate
    if case == "inf-grad-norm":
        assert math.isfinite(got["train/loss"])
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param, before[name]), name
    # The next step is the same as a fresh trainer's first (the skip left no optimizer state).
    good = _groups(model, _off_policy)
    after = trainer._train_step(good)
    fresh = megatron_trainer(model, "tis", warmup_steps=2)
    expected = fresh._train_step(good)
    assert (after["train/skipped_steps"], after["train/applied_updates"]) == (1.0, 1.0)
    assert after["train/lr"] == expected["train/lr"] == LR  # the second update's rate, both
    assert after["train/loss"] == pytest.approx(expected["train/loss"], rel=1e-6)
    for (name, a), b in zip(trainer.model.named_parameters(), fresh.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_a_megatron_update_whose_loss_alone_is_not_finite_is_skipped(
    megatron_trainer: Callable[..., object],
) -> None:
    model = _model()
    trainer = megatron_trainer(model, "tis", policy_loss=INFINITE_LOSS)
    before = _params(trainer.model)
    got = trainer._train_step(_groups(model, _off_policy))
    assert (got["train/skipped_steps"], got["train/applied_updates"]) == (1.0, 0.0)
    assert not math.isfinite(got["train/loss"])
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param, before[name]), name


def test_the_megatron_step_trains_in_train_mode_after_an_engine_served_in_eval_mode(
    megatron_trainer: Callable[..., object],
) -> None:
    """Colocated, megatron's engine puts the shared module in eval mode to serve; the trainer's
    step puts it back (activation recomputation, for one, runs only in train mode)."""
    model = _model()
    trainer = megatron_trainer(model, "tis")
    trainer.model.eval()
    modes: list[bool] = []
    trainer.model.register_forward_pre_hook(lambda module, args: modes.append(module.training))
    trainer._train_step(_groups(model, _off_policy))
    assert modes and all(modes)
