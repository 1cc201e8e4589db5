"""Chunked, recomputing logprobs equal the plain log_softmax, in values and gradients."""

from __future__ import annotations

import pytest
import torch

import backends.torch.logprobs as logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_picked_logprobs_match_log_softmax(monkeypatch: pytest.MonkeyPatch, temperature: float) -> None:
    monkeypatch.setattr(logprobs, "_CHUNK_ELEMENTS", 3 * 50)  # three rows a chunk: several chunks
    torch.manual_seed(0)
    hidden = torch.randn(4, 5, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (4, 5))
    upstream = torch.randn(4, 5, dtype=torch.float64)

    ours = logprobs.picked_logprobs(hidden, weight, targets, temperature)
    (ours * upstream).sum().backward()
    ours_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad, weight.grad = None, None

    logits = (hidden @ weight.T).float() / temperature
    reference = torch.log_softmax(logits, -1).gather(-1, targets[..., None])
    (reference.squeeze(-1) * upstream).sum().backward()
    torch.testing.assert_close(ours, reference.squeeze(-1).float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_grads[0], hidden.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_grads[1], weight.grad, atol=1e-5, rtol=1e-5)


def test_forward_only_and_gradient_keeping_paths_give_the_same_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(logprobs, "_CHUNK_ELEMENTS", 3 * 50)
    torch.manual_seed(0)
    hidden = torch.randn(7, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (7,))
    with torch.no_grad():
        plain = logprobs.picked_logprobs(hidden, weight, targets)
    kept = logprobs.picked_logprobs(hidden, weight, targets)
    torch.testing.assert_close(plain, kept, atol=0, rtol=0)


def test_no_chunk_is_one_row_unless_the_rows_are_one() -> None:
    """Chunks of 8 rows cover every row in order, the last one shorter, except that one row
    past whole chunks joins the chunk before (9 rows)."""
    for n in range(1, 40):
        chunks = logprobs._chunks(n, 8)
        assert [i for part in chunks for i in range(part.start, part.stop)] == list(range(n))
        sizes = [part.stop - part.start for part in chunks]
        assert all(2 <= size <= 9 for size in sizes) or n == 1, (n, sizes)
        assert sizes[:-1] == [8] * (len(sizes) - 1), (n, sizes)


def test_one_row_past_whole_chunks_compiles_no_graph_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled as on CUDA (here on the CPU): after micro-batches of 20 and 13 rows (chunks of
    8 and 4, then 8 and 5: a graph for 8 rows, then one for any number), 17 rows (8, 8 and 1,
    run as 8 and 9) compile nothing: a chunk of one row would (dynamo specialises sizes 0 and
    1), seconds in a GPU's train step."""
    from backends.torch.compiles import compiled_graphs

    monkeypatch.setattr(logprobs, "_CHUNK_ELEMENTS", 8 * 50)
    compiled: dict[str, object] = {}

    def on(device: torch.device, name: str, fn: object) -> object:
        if name not in compiled:
            compiled[name] = torch.compile(fn)
        return compiled[name]

    monkeypatch.setattr(logprobs, "_on", on)
    torch.manual_seed(0)
    weight = torch.randn(50, 16)

    def step(rows: int) -> None:
        hidden = torch.randn(rows, 16, requires_grad=True)
        logprobs.picked_logprobs(hidden, weight, torch.randint(0, 50, (rows,))).sum().backward()

    for rows in (20, 13):
        step(rows)
    before = compiled_graphs()
    step(17)
    assert compiled_graphs() == before
