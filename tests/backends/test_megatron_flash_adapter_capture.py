"""The flash adapter's choice of block-table columns, on the CPU: cut to the step's longest row
when it runs, every column while a CUDA graph is being captured (no device sync in a capture;
tests/gpu/test_megatron_flash_adapter.py replays such a capture)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from backends.megatron import flash_adapter  # noqa: E402


def _table() -> torch.Tensor:
    return torch.arange(3 * 8, dtype=torch.int32).view(3, 8)


def test_a_step_gathers_only_the_blocks_of_its_longest_row() -> None:
    used = flash_adapter._used(_table(), 2, lambda: 300, 256)
    assert torch.equal(used, _table()[:2, :2])


def test_a_captured_step_gathers_every_column_without_asking_the_rows_lengths(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)

    def longest() -> int:
        raise AssertionError("a capture must not read the rows' lengths (a device sync)")

    assert torch.equal(flash_adapter._used(_table(), 2, longest, 256), _table()[:2])
