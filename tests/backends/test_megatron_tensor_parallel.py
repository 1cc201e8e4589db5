"""Tensor parallel 2 over gloo (two processes) trains as tensor parallel 1 does."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from backends.megatron import layout, parallel  # noqa: E402
from backends.torch.model import Decoder  # noqa: E402
from tests.backends.megatron_cases import groups  # noqa: E402
from tests.backends.megatron_tp_case import CONFIG, trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tensor_parallel_2_gives_the_loss_and_gradients_of_tensor_parallel_1_and_reshards_on_load(
    tmp_path: Path,
) -> None:
    out = tmp_path / "rank0.pt"
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.backends.megatron_tp_rank", str(r), "2", str(port), str(out)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs = [p.communicate(timeout=600)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], logs
    two = torch.load(out, weights_only=True)

    parallel.initialise(device=torch.device("cpu"))
    torch.manual_seed(0)
    hf = Decoder(CONFIG).state_dict()
    one = trainer(hf, rank=0, size=1)
    expected = one._train_step(groups())
    grads = layout.to_hf([{n: p.grad for n, p in one.model.named_parameters()}], CONFIG)

    for key, value in hf.items():  # sharded by layout.to_megatron, gathered back by reshard
        assert torch.equal(two["before"][key], value), key
    for key, value in expected.items():
        assert two["metrics"][key] == pytest.approx(value, abs=1e-5, rel=1e-5), key
    assert expected["train/grad_norm"] > 0.5  # the norm over shards decides the clip scale
    for key, value in grads.items():
        torch.testing.assert_close(two["grads"][key], value, atol=1e-5, rtol=0, msg=key)

    # The checkpoint of two ranks' shards loads into one rank whole.
    one.load(tmp_path)
    loaded = layout.to_hf([layout.parameters(one.model)], CONFIG)
    for key, value in two["after"].items():
        assert torch.equal(loaded[key], value), key
    assert one.completed_steps == 1 and one.optimizer.optimizer.state
