"""The sampler's decode step attending by `paged_decode`'s split-key kernels over the `KVCache`
(its [rows, KV heads, length, D] keys read as [rows, length, KV heads, D] blocks), on the CPU
through Triton's interpreter (tests/backends/decode_split_case.py, in a process of its own)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from backends.torch import paged_decode  # noqa: E402
from backends.torch.config import ModelConfig  # noqa: E402
from backends.torch.decode_step import DecodeSteps  # noqa: E402
from backends.torch.kv_cache import KVCache  # noqa: E402
from backends.torch.kv_pool import PlainPool  # noqa: E402
from backends.torch.model import Decoder  # noqa: E402
from tests.backends.decode_split_case import SHAPES  # noqa: E402
from tests.backends.interpreted import run_interpreted  # noqa: E402


def test_a_split_key_step_gives_the_masked_steps_logits() -> None:
    """Rows at different positions (one at 0, as padding rows), GQA groups of 2 and 3, a
    head_dim other than hidden / heads: the step's logits by `paged_decode`, each row's keys
    split in 4 or unsplit (a batch wide enough to fill a GPU alone), are the logits of the same
    step attending by `attend` over each row's first position + 1 keys, and every layer went
    through the kernel at either width."""
    got = run_interpreted("tests.backends.decode_split_case")
    assert all(error < 1e-5 for error in got["errors"].values()), got
    want = {f"{name}_splits_{n}": 2 for name in SHAPES for n in (4, 1)}  # each of the two layers
    assert got["calls"] == want, got


@pytest.mark.parametrize(("head_dim", "split"), [(24, False), (80, False), (8, False), (64, True)])
def test_only_head_dims_the_kernels_take_split_keys(head_dim: int, split: bool) -> None:
    """Flash takes head dims that are not powers of two (or below 16), `paged_decode`'s kernels
    do not (Triton refuses to build them): a model with one keeps flash's path."""
    config = ModelConfig(
        vocab_size=20, hidden_size=32, intermediate_size=64, num_hidden_layers=1, head_dim=head_dim
    )
    cache = KVCache(config, torch.float32, PlainPool(torch.device("cpu")), zero_fresh=True)
    steps = DecodeSteps(
        Decoder(config), cache, graphs=False, flash=True, compiled=False, eager_rounding=False
    )
    assert steps.split_keys == split
    assert paged_decode.takes_head_dim(head_dim) == split
