"""The megatron trainer against the torch trainer on the same groups, and its checkpoints."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import anyio
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from backends.megatron import layout, parallel, reshard  # noqa: E402
from backends.megatron.model import build_gpt_model  # noqa: E402
from backends.megatron.optimizer import TorchAdamW  # noqa: E402
from backends.megatron.trainer import MegatronTrainer, by_length  # noqa: E402
from backends.torch.model import Decoder  # noqa: E402
from backends.torch.trainer import TorchTrainer  # noqa: E402
from pipeline.algorithms.config import Algorithm, LossConfig  # noqa: E402
from pipeline.contracts.errors import DamagedState, NonFiniteState  # noqa: E402
from pipeline.contracts.messages import TrainGroup  # noqa: E402
from tests.backends.megatron_cases import CONFIGS, groups  # noqa: E402
from tests.backends.trainer_inputs import batching, optimizer  # noqa: E402

CPU = torch.device("cpu")
LOSS = Algorithm(loss=LossConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.0, is_correction="tis", is_cap=2.0))
# The loss variants, each as the trainers take it (advantages are the samples' own).
VARIANTS = {
    "grpo": LOSS,
    "dr_grpo": replace(LOSS, loss_aggregation="token_sum", max_response_tokens=9),
    "gspo": replace(LOSS, policy_loss="sequence", loss_aggregation="sequence_mean"),
    "custom": replace(LOSS, policy_loss="tests.pipeline.algorithms.custom_loss:squared_advantage"),
}
OPTIMIZER = optimizer(weight_decay=0.01, grad_clip=0.5, warmup_steps=2, schedule="cosine")


@pytest.fixture(scope="module", autouse=True)
def _groups() -> None:
    parallel.initialise(device=CPU)


def megatron_trainer(
    config,
    hf,
    *,
    updates_per_step: int = 1,
    micro_batch_samples: int = 5,
    micro_batch_tokens: int = 0,
    algorithm: Algorithm = LOSS,
) -> MegatronTrainer:
    model = build_gpt_model(config, dtype=torch.float32, device=CPU)
    layout.load_hf(model, hf, config)
    step = TorchAdamW(model, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01, grad_clip=0.5)
    return MegatronTrainer(
        model,
        step,
        config=config,
        algorithm=algorithm,
        optimizer=OPTIMIZER,
        batching=batching(
            micro_batch_samples=micro_batch_samples,
            micro_batch_tokens=micro_batch_tokens,
            updates_per_step=updates_per_step,
        ),
        temperature=0.7,
        seed=3,
    )


@pytest.mark.parametrize(
    ("name", "variant"),
    [("qwen2-bias", "grpo"), ("qwen3-qk-norm-tied", "grpo"), ("learned-positions", "grpo")]
    + [("qwen2-bias", variant) for variant in VARIANTS if variant != "grpo"],
)
async def test_same_loss_metrics_and_gradients_as_the_torch_trainer(name: str, variant: str) -> None:
    """Every loss variant is the one update loop's: both trainers compute it alike."""
    config = CONFIGS[name]
    torch.manual_seed(0)
    decoder = Decoder(config)
    ours = megatron_trainer(config, decoder.state_dict(), algorithm=VARIANTS[variant])
    theirs = TorchTrainer(
        decoder,
        algorithm=VARIANTS[variant],
        optimizer=OPTIMIZER,
        batching=batching(micro_batch_samples=7),
        temperature=0.7,
        seed=3,
    )
    batch = groups()
    got, expected = await ours.train_step(batch), await theirs.train_step(batch)
    ours.close()
    theirs.close()
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        if key == "train/computed_tokens":  # each backend's own cost: megatron pads, torch packs
            assert got[key] >= got["train/tokens"]
            continue
        assert got[key] == pytest.approx(value, abs=1e-6, rel=1e-6), key
    assert expected["train/grad_norm"] > 0.5  # clipped: the clip scale is compared too
    # The gradients, clipped, left on both models by their one optimizer update.
    hf_grads = layout.to_hf([{n: p.grad for n, p in ours.model.named_parameters()}], config)
    grads = dict(reshard.as_parameters(hf_grads, config))
    for name_, param in decoder.named_parameters():
        torch.testing.assert_close(grads[name_], param.grad, atol=1e-6, rtol=0, msg=name_)


def _long_tailed() -> list[TrainGroup]:
    """Three groups of four whose responses are 1-3 tokens but one of 30 in the first group."""
    return groups(seed=5, length=lambda g, s: 30 if (g, s) == (0, 1) else 1 + (s + g) % 3)


def test_by_length_fits_each_micro_batch_to_the_budget_longest_first() -> None:
    rows = [(g.prompt_tokens, s) for g in _long_tailed() for s in g.samples]
    parts = by_length(rows, budget=24, most=5)
    assert sorted(id(s) for part in parts for _, s in part) == sorted(id(s) for _, s in rows)  # each once
    widths = [[len(p) + len(s.tokens) for p, s in part] for part in parts]
    assert widths[0] == [34]  # over the budget: alone
    for part in widths[1:]:
        assert len(part) <= 5 and len(part) * part[0] <= 24 and part == sorted(part, reverse=True)
    assert [w for part in widths for w in part] == sorted((w for part in widths for w in part), reverse=True)


async def test_token_budgeted_micro_batches_give_the_same_update_with_less_padding() -> None:
    """`train.micro_batch_tokens`: samples grouped by length under a budget of padded tokens
    train to the same metrics and gradients as whole groups padded to their longest, and pad
    less (`train/computed_tokens`)."""
    config = CONFIGS["qwen2-bias"]
    torch.manual_seed(0)
    hf = Decoder(config).state_dict()
    budgeted = megatron_trainer(config, hf, micro_batch_samples=8, micro_batch_tokens=24)
    whole = megatron_trainer(config, hf, micro_batch_samples=8)
    batch = _long_tailed()
    got, expected = await budgeted.train_step(batch), await whole.train_step(batch)
    budgeted.close()
    whole.close()
    assert got["train/computed_tokens"] < expected["train/computed_tokens"] / 2
    for key, value in expected.items():
        if key != "train/computed_tokens":
            assert got[key] == pytest.approx(value, abs=1e-6, rel=1e-5), key
    # The gradients, clipped, left on both models by their one update (Adam's steps of
    # near-zero gradients would magnify rounding in the weights).
    for (name, ours), theirs in zip(budgeted.model.named_parameters(), whole.model.parameters(), strict=True):
        assert ours.grad is not None and theirs.grad is not None, name
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("how", ["save", "snapshot"])
async def test_resume_continues_bit_for_bit(tmp_path: Path, how: str) -> None:
    # Two updates a step: the shuffle (the generator), the schedule's position, the optimizer's
    # moments and step counts all shape the step after the checkpoint. A snapshot is written
    # only after the next step has changed the live state (an asynchronous checkpoint).
    config = CONFIGS["llama"]
    torch.manual_seed(0)
    hf = Decoder(config).state_dict()
    first = megatron_trainer(config, hf, updates_per_step=2, micro_batch_samples=4)
    await first.train_step(groups(seed=1))
    if how == "save":
        await first.compute.run(first.save, tmp_path)
    else:
        snapshot = await anyio.to_thread.run_sync(first.snapshot, tmp_path)
    expected = await first.train_step(groups(seed=2))
    if how == "snapshot":
        await anyio.to_thread.run_sync(snapshot.write)
    torch.manual_seed(5)
    resumed = megatron_trainer(
        config, Decoder(config).state_dict(), updates_per_step=2, micro_batch_samples=4
    )
    await resumed.compute.run(resumed.load, tmp_path)
    got = await resumed.train_step(groups(seed=2))
    assert got == expected
    for (name, a), b in zip(first.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "megatron",
        "megatron-trainer.pt",
        "megatron-trainer.tensors",
    ]
    first.close()
    resumed.close()


async def test_a_damaged_checkpoint_is_refused_before_anything_changes(tmp_path: Path) -> None:
    config = CONFIGS["llama"]
    torch.manual_seed(0)
    trainer = megatron_trainer(config, Decoder(config).state_dict())
    await trainer.train_step(groups())
    await trainer.compute.run(trainer.save, tmp_path)
    (shard,) = (tmp_path / "megatron").glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:100])  # torn
    await trainer.train_step(groups(seed=2))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(DamagedState, match=r"^megatron/ does not load: "):
        await trainer.compute.run(trainer.load, tmp_path)
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert trainer.completed_steps == 2
    trainer.close()


async def test_non_finite_weights_are_never_saved(tmp_path: Path) -> None:
    config = CONFIGS["llama"]
    trainer = megatron_trainer(config, Decoder(config).state_dict())
    with torch.no_grad():
        trainer.model.decoder.final_layernorm.weight[3] = float("inf")
    with pytest.raises(NonFiniteState) as error:
        await trainer.compute.run(trainer.save, tmp_path)
    assert str(error.value) == "megatron/ would hold non-finite values at decoder.final_layernorm.weight"
    assert list(tmp_path.iterdir()) == []
    trainer.close()


async def test_a_save_whose_shards_cannot_be_written_is_an_oserror_naming_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk under dist_checkpointing's writer came back as a BaseException (torch's
    CheckpointException) that the checkpoint treated as a bug: a 90-line traceback, exit 1. As
    an OSError the save fails in one line (`CheckpointError`), naming the folder."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def full_disk(*_: object, **__: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(filesystem_async, "_write_item", full_disk)
    trainer = megatron_trainer(CONFIGS["llama"], Decoder(CONFIGS["llama"]).state_dict())
    with pytest.raises(OSError) as error:
        await trainer.compute.run(trainer.save, tmp_path)
    # megatron's own message names the cause's type only; its error log line, before, says it all.
    assert re.fullmatch(
        r"writing megatron failed \([0-9.]+ GiB free on its disk\): RuntimeError: Worker failure: An "
        r"error is caught while starting worker 0, error: <class 'OSError'>",
        str(error.value),
    ), str(error.value)
    trainer.close()
