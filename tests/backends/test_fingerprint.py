"""Weight fingerprints: a changed or swapped row shows, bf16 bits are checksummed exactly."""

from __future__ import annotations

import torch

from backends.torch.fingerprint import Fingerprinter, checksum, parameter_probe


def test_checksum_sees_a_changed_row_and_swapped_rows() -> None:
    weight = torch.randn(64, 32)
    before = Fingerprinter([parameter_probe("w", weight)])()["w"]
    swapped = weight[[1, 0, *range(2, 64)]].contiguous()
    assert Fingerprinter([parameter_probe("w", swapped)])()["w"] != before
    weight[40].add_(0.5)  # a whole row, as a missed copy of a shard would leave it
    assert Fingerprinter([parameter_probe("w", weight)])()["w"] != before
    # bf16 values are checksummed by their bits, exactly.
    values = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    assert checksum(values) == 0x3F80 * 1 + (0xC000 - 0x10000) * 3
