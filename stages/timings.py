"""Seconds each stage spent on each batch, gathered for the batch's metrics line.

Stages report against the batch (`target_step`) they worked for; the train stage takes the
batch's figures when it trains it. `add` sums work time (reward scoring, prompt loading);
`span` keeps the window from the first start to the last end (generation, whose requests
overlap).
"""

from __future__ import annotations

from collections import defaultdict


class BatchTimings:
    def __init__(self) -> None:
        self._sums: defaultdict[int, dict[str, float]] = defaultdict(dict)
        self._spans: defaultdict[int, dict[str, tuple[float, float]]] = defaultdict(dict)

    def add(self, batch: int, key: str, seconds: float) -> None:
        sums = self._sums[batch]
        sums[key] = sums.get(key, 0.0) + seconds

    def span(self, batch: int, key: str, start: float, end: float) -> None:
        first, last = self._spans[batch].get(key, (start, end))
        self._spans[batch][key] = (min(first, start), max(last, end))

    def pop(self, batch: int) -> dict[str, float]:
        """`timing/<key>_s` for every figure recorded for `batch`, forgetting them."""
        figures = dict(self._sums.pop(batch, {}))
        for key, (start, end) in self._spans.pop(batch, {}).items():
            figures[key] = end - start
        return {f"timing/{key}_s": seconds for key, seconds in sorted(figures.items())}
