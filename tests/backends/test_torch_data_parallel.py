"""Data parallel 2 trains as data parallel 1 does: the same losses, gradient norms and
metrics, and the same weights after each step, for every algorithm variant (float32).

The two ranks are threads of this process, each a `TorchTrainer` over one gloo process group
(the collectives are gloo's, as the Ray actors' are); `test_ray_data_parallel.py` runs them as
Ray actors through the placement.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from backends.torch.config import ModelConfig
from backends.torch.data_parallel import RankGroup, owners
from backends.torch.model import Decoder
from backends.torch.trainer import TorchTrainer
from pipeline.algorithms.config import Algorithm
from pipeline.algorithms.presets import resolve
from pipeline.algorithms.update import shares
from pipeline.contracts.messages import TrainGroup, TrainSample
from stages.train import TrainSection
from tests.backends.trainer_inputs import batching, optimizer

CONFIG = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
CUSTOM = "tests.pipeline.algorithms.custom_loss:squared_advantage"


def variant(name: str) -> Algorithm:
    section = TrainSection(policy_loss=CUSTOM) if name == "custom" else TrainSection(algorithm=name)  # type: ignore[arg-type]
    return resolve(section, max_response_tokens=9, samples_per_prompt=4)


def groups(seed: int, vocab: int = 24, *, episodes: bool = False) -> list[TrainGroup]:
    """Five groups of four: prompts and responses of different lengths, behaviour logprobs off
    the model's (so the IS correction and the mismatch metrics have work); with `episodes`,
    multi-turn samples whose every third token is an environment's (loss mask 0)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for gi in range(5):
        prompt = torch.randint(0, vocab, (3 + gi % 3,), generator=g).tolist()
        samples = []
        for si in range(4):
            length = 1 + (si * 3 + gi * 2) % 8
            samples.append(
                TrainSample(
                    tokens=tuple(torch.randint(0, vocab, (length,), generator=g).tolist()),
                    logprobs=tuple((-torch.rand(length, generator=g) * 3 - 2).tolist()),
                    reward=float(si % 2),
                    advantage=float(si) - 1.5 + 0.1 * gi,
                    loss_mask=tuple(int(j % 3 != 1) for j in range(length)) if episodes else (),
                )
            )
        out.append(TrainGroup(group_id=f"g{gi}", prompt_tokens=tuple(prompt), samples=tuple(samples)))
    return out


def model() -> Decoder:
    torch.manual_seed(0)
    return Decoder(CONFIG)


def trainer(algorithm: Algorithm, start: Decoder, ranks: RankGroup | None = None) -> TorchTrainer:
    return TorchTrainer(
        start,
        algorithm=algorithm,
        optimizer=optimizer(weight_decay=0.01, grad_clip=0.5),
        batching=batching(micro_batch_samples=4, updates_per_step=2),
        temperature=0.7,
        seed=3,
        ranks=ranks,
    )


def run_ranks(algorithm: Algorithm, size: int, steps: list[list[TrainGroup]]) -> list[Any]:
    """Each rank's (metrics of every step, its weights after the last), the ranks as threads."""
    store = dist.HashStore()
    # Built here, not in the threads: torch's seed and default generator are the process's.
    models = [model() for _ in range(size)]
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore("dp", store), r, size, timedelta(seconds=60))
            ours = trainer(algorithm, models[r], RankGroup.of(group, rank=r, size=size))
            metrics = [ours._train_step(batch) for batch in steps]
            results[r] = (metrics, {n: p.detach().clone() for n, p in ours.model.named_parameters()})
            ours.close()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not errors, errors
    return results


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo", "gspo", "rloo", "custom", "grpo-episodes"])
def test_two_ranks_train_as_one_on_the_same_groups(name: str) -> None:
    """Catches a rank that trains another's groups or all of them, a loss normalised by the
    rank's own counts instead of the minibatch's, gradients not summed over the ranks, an
    optimizer shard not stepped or not shared, and metrics of one rank only."""
    algorithm = variant(name.removesuffix("-episodes"))
    episodes = name.endswith("-episodes")
    # The second step runs on the sharded optimizer's moments.
    steps = [groups(1, episodes=episodes), groups(2, episodes=episodes)]
    one = trainer(algorithm, model())
    expected = [one._train_step(batch) for batch in steps]
    weights = {n: p.detach() for n, p in one.model.named_parameters()}
    one.close()
    ranks = run_ranks(algorithm, 2, steps)
    for metrics, rank_weights in ranks:
        for got, want in zip(metrics, expected, strict=True):
            assert got.keys() == want.keys()
            for key, value in want.items():
                if key == "train/computed_tokens":  # the work, not the update: each rank packs its
                    continue  # own micro-batches (its prompts padded to its own widest)
                assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)
        for key, value in weights.items():
            torch.testing.assert_close(rank_weights[key], value, atol=1e-5, rtol=1e-5, msg=key)
    first, second = ranks[0][1], ranks[1][1]
    assert all(torch.equal(first[k], second[k]) for k in first)  # replicas: bit for bit
    assert expected[0]["train/grad_norm"] > 0.5  # clipped: the clip scale is compared too
    # The counts the loss is normalised by are of the model's tokens, not an environment's.
    trained = [
        sum(sum(s.loss_mask) if episodes else len(s.tokens) for g in b for s in g.samples) for b in steps
    ]
    assert [m["train/tokens"] for m in expected] == trained


def test_shares_are_whole_groups_balanced_by_tokens() -> None:
    batch = groups(1)
    split = shares(batch, 2)
    assert sorted(split[0] + split[1]) == list(range(len(batch)))  # each group once, whole
    tokens = [
        sum(len(b.prompt_tokens) + sum(len(s.tokens) for s in b.samples) for b in map(batch.__getitem__, s))
        for s in split
    ]
    biggest = max(len(b.prompt_tokens) + sum(len(s.tokens) for s in b.samples) for b in batch)
    assert abs(tokens[0] - tokens[1]) <= biggest
    assert shares(batch[:1], 2) == [[0], []]  # fewer groups than ranks: a rank trains none


def test_every_parameter_has_one_owner_and_the_sizes_are_balanced() -> None:
    params = list(Decoder(CONFIG).parameters())
    owner = owners(params, 2)
    sizes = [sum(p.numel() for p, o in zip(params, owner, strict=True) if o == r) for r in range(2)]
    assert set(owner) == {0, 1} and abs(sizes[0] - sizes[1]) <= max(p.numel() for p in params)
