"""bench/gpu.py's `stream` (the long_tail part), on CPU with a tiny model."""

from __future__ import annotations

import pytest
import torch

from backends.torch.config import ModelConfig
from backends.torch.model import Decoder
from backends.torch.sampler import Admission, Sampler
from bench.gpu import stream


@pytest.mark.parametrize(
    ("continuous", "loops", "slot_steps"),
    [(True, 1, 6 * 4), (False, 2, 6 * 4 + 3 * 4)],
    ids=["continuous", "before"],
)
def test_stream_admits_requests_as_slots_free_or_runs_fixed_batches(
    continuous: bool, loops: int, slot_steps: int
) -> None:
    """Four requests of two rows through four slots. Continuous: the third request takes the
    slots the second frees at step 2 and the fourth those of the third's short row at step 3,
    all within the first request's 6 steps; before: two fixed loops, to 6 and to 3 steps."""
    torch.manual_seed(0)
    sampler = Sampler(Decoder(ModelConfig(vocab_size=29, hidden_size=64, max_position_embeddings=64)))
    limits = [[1, 6], [2, 2], [3, 1], [1, 1]]
    requests = [Admission([1, 2, 3], rows, i) for i, rows in enumerate(limits)]
    got = stream(
        sampler,
        requests,
        4,
        continuous=continuous,
        max_new_tokens=6,
        temperature=0.0,
        generator=torch.Generator().manual_seed(0),
    )
    assert (got["loops"], got["tokens"]) == (loops, 17)
    assert got["idle_slot_fraction"] == pytest.approx(1 - 17 / slot_steps)
