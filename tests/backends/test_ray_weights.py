"""Weight packages: a version's package is a snapshot, checked on arrival against the announced
version and the engine's own parameters."""

from __future__ import annotations

import pytest
import torch

from backends.ray.weights import WeightsMismatch, pack, unpack


def parameters() -> list[tuple[str, torch.Tensor]]:
    return [("a.weight", torch.ones(2, 3)), ("b.weight", torch.zeros(4))]


def test_an_object_store_package_is_a_copy_of_the_version_it_was_packed_at() -> None:
    trainer = parameters()
    package = pack(3, trainer, "object_store")
    trainer[0][1].add_(1.0)  # the next step changes the trainer's weights
    got = unpack(package, version=3, like=parameters())
    assert torch.equal(got["a.weight"], torch.ones(2, 3))


def test_a_package_of_another_version_is_refused() -> None:
    package = pack(3, parameters(), "object_store")
    with pytest.raises(WeightsMismatch) as raised:
        unpack(package, version=4, like=parameters())
    assert str(raised.value) == "weights of version 3 arrived for the refit to version 4"


def test_a_package_missing_a_parameter_or_of_another_shape_is_refused() -> None:
    package = pack(1, parameters()[:1], "object_store")
    with pytest.raises(WeightsMismatch) as raised:
        unpack(package, version=1, like=parameters())
    assert str(raised.value) == "weights of version 1: missing ['b.weight'], unexpected []"
    wide = pack(1, [("a.weight", torch.ones(2, 4)), ("b.weight", torch.zeros(4))], "object_store")
    with pytest.raises(WeightsMismatch) as raised:
        unpack(wide, version=1, like=parameters())
    assert str(raised.value) == (
        "weights of version 1: a.weight is (2, 4) torch.float32, the engine's is (2, 3) torch.float32"
    )
