"""A state's tensors in a raw file of their own: what comes back is what went in, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends.torch import tensor_file
from backends.torch.tensor_file import StoredTensor, read_tensors, write_tensors


def _state() -> dict[str, object]:
    weight = torch.randn(7, 5)
    return {
        "model": {"w": weight, "half": torch.randn(3, 3).bfloat16(), "ids": torch.arange(11)},
        "tied": [weight],  # the same tensor twice: written once, one tensor again when read
        "flags": (torch.tensor([True, False]), torch.tensor(2.5, dtype=torch.float64)),
        "empty": torch.empty(0, 4),
        "step": 3,
        "name": "x",
    }


@pytest.mark.parametrize("mmap", [False, True])
def test_a_state_comes_back_bit_for_bit_with_ties_kept(tmp_path: Path, mmap: bool) -> None:
    state = _state()
    skeleton = write_tensors(tmp_path / "t.tensors", state)
    assert isinstance(skeleton["model"]["w"], StoredTensor)
    assert skeleton["tied"][0] == skeleton["model"]["w"]
    loaded = read_tensors(tmp_path / "t.tensors", skeleton, mmap=mmap)
    assert loaded["tied"][0] is loaded["model"]["w"]
    for key in ("w", "half", "ids"):
        got, want = loaded["model"][key], state["model"][key]
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(loaded["flags"][0], state["flags"][0]) and loaded["flags"][1].item() == 2.5
    assert loaded["empty"].shape == (0, 4) and (loaded["step"], loaded["name"]) == (3, "x")


def test_tensors_larger_than_a_chunk_are_written_and_read_in_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many threads write and read pieces of `CHUNK` bytes: every piece lands at its place."""
    monkeypatch.setattr(tensor_file, "CHUNK", 1000)
    state = {"a": torch.randn(3001), "b": torch.randn(17).double(), "c": torch.randint(0, 9, (999,))}
    skeleton = write_tensors(tmp_path / "t.tensors", state)
    loaded = read_tensors(tmp_path / "t.tensors", skeleton)
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_a_view_is_written_as_its_own_elements(tmp_path: Path) -> None:
    base = torch.arange(20.0).reshape(4, 5)
    skeleton = write_tensors(tmp_path / "t.tensors", {"columns": base[:, 1:3]})
    assert torch.equal(read_tensors(tmp_path / "t.tensors", skeleton)["columns"], base[:, 1:3])


def test_a_short_file_or_an_unknown_dtype_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.tensors"
    skeleton = write_tensors(path, {"w": torch.randn(64)})
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(OSError, match=r"^t.tensors holds 100 bytes, a tensor ends at 256$"):
        read_tensors(path, skeleton)
    with pytest.raises(ValueError, match="unknown dtype 'nonsense'"):
        read_tensors(path, {"w": StoredTensor(0, "nonsense", (1,))})
