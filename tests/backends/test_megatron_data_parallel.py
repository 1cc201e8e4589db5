"""megatron's data parallelism over gloo (processes): data parallel 2, and data parallel 2 x
tensor parallel 2 (4 ranks), give the loss, metrics, gradients and updated weights of one rank
on the same groups (float32)."""

from __future__ import annotations

import os
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
from tests.backends.test_megatron_tensor_parallel import _free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("size", "tp"), [(2, 1), (4, 2)], ids=["dp2", "dp2xtp2"])
def test_data_parallel_ranks_give_the_step_of_one(tmp_path: Path, size: int, tp: int) -> None:
    """Catches ranks that train every group (or the wrong share), a loss not normalised by the
    whole step's counts, gradients not summed over the data-parallel group (or summed over the
    tensor-parallel one), and metrics of one rank's groups only."""
    out = tmp_path / "rank0.pt"
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "tests.backends.megatron_tp_rank"]
    ranks = [
        subprocess.Popen(
            [*command, str(r), str(size), str(port), str(out), str(tp)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(size)
    ]
    logs = [p.communicate(timeout=600)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0] * size, logs
    many = torch.load(out, weights_only=True)

    parallel.initialise(device=torch.device("cpu"))
    torch.manual_seed(0)
    hf = Decoder(CONFIG).state_dict()
    one = trainer(hf, rank=0, size=1)
    expected = one._train_step(groups())
    grads = layout.to_hf([{n: p.grad for n, p in one.model.named_parameters()}], CONFIG)
    after = layout.to_hf([layout.parameters(one.model)], CONFIG)
    one.close()
    assert many["metrics"].keys() == expected.keys()
    for key, value in expected.items():
        if key != "train/computed_tokens":  # the work, which each rank's packing decides
            assert many["metrics"][key] == pytest.approx(value, abs=1e-5, rel=1e-5), key
    assert expected["train/grad_norm"] > 0.5  # clipped: the summed gradients' norm decides it
    for key, value in grads.items():
        torch.testing.assert_close(many["grads"][key], value, atol=1e-5, rtol=0, msg=key)
    for key, value in after.items():
        torch.testing.assert_close(many["after"][key], value, atol=1e-5, rtol=1e-5, msg=key)
