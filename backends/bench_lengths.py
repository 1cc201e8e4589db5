"""A benchmark aid: response lengths drawn from a stated distribution, for random weights.

Random weights almost never emit an end-of-sequence token, so every sample runs to
`rollout.max_new_tokens` and a benchmark measures only the easy, fixed-length case.
`rollout.bench_lengths` ends each sample instead at a length drawn from a lognormal
distribution (finish_reason "stop", as if the model had emitted its end-of-sequence token; the
tokens themselves are what the model sampled). A draw at or past `max_new_tokens` is cut there
(finish_reason "length"). Off by default; never for a run meant to learn.

Lengths come from their own generator, seeded from the run's seed, so they do not disturb the
sampling's randomness; its state is saved with the engine's, so a resumed run continues the
same sequence. Median 256 with sigma 0.9 puts the 99th percentile at about 2075 tokens
(256 * exp(2.326 * 0.9)): `max_new_tokens` 2048 cuts about 1% of the samples.
"""

from __future__ import annotations

import math
import random
from typing import Any

from pipeline.contracts.backend_input import Sampling
from pipeline.contracts.sections import BenchLengths


class LengthDraw:
    """Draws each sample's length limit (1..max_new_tokens) from `BenchLengths`."""

    def __init__(self, lengths: BenchLengths, *, max_new_tokens: int, seed: int) -> None:
        self.mu = math.log(lengths.median_tokens)
        self.sigma = lengths.sigma
        self.max_new_tokens = max_new_tokens
        self.rng = random.Random(f"bench-lengths-{seed}")

    def draw(self, n: int) -> list[int]:
        return [
            min(self.max_new_tokens, max(1, round(self.rng.lognormvariate(self.mu, self.sigma))))
            for _ in range(n)
        ]

    def state(self) -> list[Any]:
        version, internal, gauss = self.rng.getstate()
        return [version, list(internal), gauss]

    def load_state(self, state: list[Any]) -> None:
        version, internal, gauss = state
        self.rng.setstate((version, tuple(internal), gauss))


def length_draw(sampling: Sampling, *, seed: int) -> LengthDraw | None:
    """An engine's draw of `rollout.bench_lengths` (None when it is off)."""
    if sampling.bench_lengths is None:
        return None
    return LengthDraw(sampling.bench_lengths, max_new_tokens=sampling.max_new_tokens, seed=seed)
