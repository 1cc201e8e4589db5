"""Builds the backend where the recipe's `placement` puts it (`backends/placement.py`), from its
typed input (`backends/input.py`)."""

from __future__ import annotations

from collections.abc import Sequence

from backends.input import Input
from backends.placement import Placed, RayPlacement


def place(spec: Input, *, vocab_size: int, stop_ids: Sequence[int]) -> Placed:
    """Build the backend where `spec.placement` says; blocking (call it on a worker thread)."""
    if isinstance(spec.placement, RayPlacement):
        from backends.ray.place import place_on_ray

        return place_on_ray(spec, vocab_size=vocab_size, stop_ids=stop_ids)
    from backends.registry import build_backend

    engine, trainer = build_backend(spec, vocab_size=vocab_size, stop_ids=stop_ids)

    def close() -> None:
        engine.close()
        trainer.close()

    return Placed(engine=engine, trainer=trainer, close=close)
