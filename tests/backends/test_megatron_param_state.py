"""megatron's distributed optimizer (`MegatronAdam`) saved at data-parallel size 1: its state as
views of the live tensors (`param_state`), the same checkpoint as megatron's gathered one."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import anyio
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron.core.dist_checkpointing.mapping import ShardedBase  # noqa: E402

from backends.megatron import checkpoint, parallel, param_state  # noqa: E402
from backends.megatron.model import build_gpt_model  # noqa: E402
from backends.megatron.optimizer import MegatronAdam  # noqa: E402
from backends.megatron.trainer import MegatronTrainer  # noqa: E402
from pipeline.algorithms.config import Algorithm, LossConfig  # noqa: E402
from tests.backends.megatron_cases import CONFIGS, cuda_named  # noqa: E402
from tests.backends.trainer_inputs import batching, optimizer  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def _groups() -> None:
    parallel.initialise(device=CPU)


def adam(seed: int) -> MegatronAdam:
    """A bf16 model in megatron's distributed optimizer, every master and moment drawn from
    `seed` (a state megatron's step would have left: its step is CUDA only)."""
    torch.manual_seed(seed)
    model = build_gpt_model(CONFIGS["qwen3-qk-norm-tied"], dtype=torch.bfloat16, device=CPU)
    with cuda_named():
        step = MegatronAdam(model, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01, grad_clip=0.5)
    step._fresh_state()
    for tensor in live_tensors(step):
        if tensor.dtype == torch.float32 and tensor.dim() > 0:
            tensor.uniform_(0.1, 1.0)
    for inner in step.optimizer.chained_optimizers:
        for state in inner.optimizer.state.values():
            state["step"].fill_(3.0)
    return step


def live_tensors(step: MegatronAdam) -> list[torch.Tensor]:
    out = []
    for inner in step.optimizer.chained_optimizers:
        for group in inner.optimizer.param_groups:
            for master in group["params"]:
                out += [master, *inner.optimizer.state[master].values()]
    return out


def gathered(step: MegatronAdam, model_state: Any) -> Any:
    """megatron's own save state in the same format (its gather over the gloo group: the CPU
    one), what `MegatronAdam` saved before."""
    metadata = {
        "distrib_optim_sharding_type": "fully_reshardable",
        "distrib_optim_fully_reshardable_mem_efficient": True,
    }
    return step.optimizer.sharded_state_dict(model_state, is_loading=False, metadata=metadata)


def same(ours: Any, theirs: Any, where: str = "") -> None:
    if isinstance(ours, ShardedBase):
        assert type(ours) is type(theirs), where
        for field in ("key", "dtype", "global_shape", "global_offset", "axis_fragmentations", "replica_id"):
            assert getattr(ours, field, None) == getattr(theirs, field, None), (where, field)
        assert torch.equal(ours.data, theirs.data), where
    elif isinstance(ours, dict):
        assert list(ours) == list(theirs), where
        for k in ours:
            same(ours[k], theirs[k], f"{where}.{k}")
    else:
        assert ours == theirs, where


def test_the_saved_state_is_megatrons_as_views_of_the_live_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    # megatron's default gather sends each shard to the device and back: on CPU it stays, so
    # that without `param_state` this test fails at its copies, not at CUDA.
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    step = adam(seed=0)
    model_state = step.model.module.sharded_state_dict()
    ours = step.sharded_state_dict(model_state, loading=False)
    same(ours, gathered(step, model_state))
    # Nothing copied: every shard reads a master or a moment where it lives.
    live = {t.untyped_storage().data_ptr() for t in live_tensors(step)}
    shards = [s for per_param in ours["param_state"].values() for s in per_param.values()]
    assert shards and all(s.data.untyped_storage().data_ptr() in live for s in shards)
    assert param_state.applies(step.optimizer)


def trainer(step: MegatronAdam) -> MegatronTrainer:
    loss = LossConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.0, is_correction="tis", is_cap=2.0)
    return MegatronTrainer(
        step.model.module,
        step,
        config=CONFIGS["qwen3-qk-norm-tied"],
        algorithm=Algorithm(loss=loss),
        optimizer=optimizer(),
        batching=batching(),
        temperature=1.0,
        seed=3,
    )


async def test_a_snapshot_loads_back_as_megatrons_gathered_save_does(tmp_path: Path) -> None:
    """The snapshot (views copied to host, written later) and a checkpoint of megatron's own
    gathered state both resume a fresh optimizer to every master and moment exactly."""
    first = trainer(adam(seed=0))
    (tmp_path / "snapshot").mkdir()
    (tmp_path / "gathered").mkdir()
    snapshot = await anyio.to_thread.run_sync(first.snapshot, tmp_path / "snapshot")
    expected = [t.clone() for t in live_tensors(first.optimizer)]
    for t in live_tensors(first.optimizer):  # the live state moves on before the write
        t.add_(1.0)
    await anyio.to_thread.run_sync(snapshot.write)
    for name in ("megatron-trainer.pt", "megatron-trainer.tensors"):
        shutil.copy(tmp_path / "snapshot" / name, tmp_path / "gathered" / name)
    for t, value in zip(live_tensors(first.optimizer), expected, strict=True):
        t.copy_(value)
    model_state = first.model.sharded_state_dict()
    state = {"model": model_state, "optimizer": gathered(first.optimizer, model_state)}
    checkpoint.save(state, tmp_path / "gathered" / "megatron")
    first.close()
    for directory in ("snapshot", "gathered"):
        resumed = trainer(adam(seed=1))
        await resumed.compute.run(resumed.load, tmp_path / directory)
        for got, want in zip(live_tensors(resumed.optimizer), expected, strict=True):
            assert torch.equal(got, want), directory
        resumed.close()
