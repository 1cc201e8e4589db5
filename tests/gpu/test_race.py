"""The CUDA sampler's one-pass Triton draw: greedy argmax, exact logprobs, and draws that
follow softmax(logits / T)."""

from __future__ import annotations

import math

import pytest
import torch

from backends.torch.race import race_draw

pytestmark = pytest.mark.gpu


def _scalars(seed: int, noisy: float, temperature: float) -> tuple[torch.Tensor, ...]:
    return (
        torch.tensor(1 / temperature, device="cuda"),
        torch.tensor(seed, dtype=torch.long, device="cuda"),
        torch.tensor(noisy, device="cuda"),
    )


def test_greedy_is_the_argmax_with_its_logprob() -> None:
    torch.manual_seed(0)
    logits = (torch.randn(37, 151936, device="cuda") * 3).bfloat16()  # vocab not a multiple of the block
    inv_t, seed, noisy = _scalars(0, 0.0, 0.7)
    token, logprob = race_draw(logits, inv_t, seed, noisy)
    reference = torch.log_softmax(logits.float() / 0.7, -1)
    assert torch.equal(token, reference.argmax(-1))
    torch.testing.assert_close(logprob, reference.gather(1, token[:, None])[:, 0], atol=2e-5, rtol=0)


def test_draws_follow_the_softmax_and_seeds_repeat() -> None:
    row = torch.tensor([-0.3, 1.0, 2.0, -1.0, 0.5, 3.0, -4.0, 2.5], device="cuda")
    logits = row.repeat(100_000, 1)  # each row draws with its own counters
    inv_t, seed, noisy = _scalars(123, 1.0, 1.3)
    token, logprob = race_draw(logits, inv_t, seed, noisy)
    probs = torch.softmax(row / 1.3, -1)
    counts = torch.bincount(token, minlength=8).float()
    expected = 100_000 * probs
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 30, (chi2, counts, expected)  # 7 degrees of freedom: p < 1e-4 by chance
    torch.testing.assert_close(logprob, probs.log()[token], atol=1e-5, rtol=0)
    again, _ = race_draw(logits, inv_t, seed, noisy)
    other, _ = race_draw(logits, inv_t, torch.tensor(124, device="cuda"), noisy)
    assert torch.equal(token, again) and not torch.equal(token, other)


def test_ties_go_to_the_lowest_column_across_lanes_and_chunks() -> None:
    logits = torch.zeros(3, 40_000, device="cuda")  # three chunks of the kernel
    logits[1, [7, 39_000]] = 1.0  # same lane set, different chunks
    logits[2, [20_000, 19_999]] = 2.0  # neighbouring lanes of one chunk
    inv_t, seed, noisy = _scalars(0, 0.0, 1.0)
    token, _ = race_draw(logits, inv_t, seed, noisy)
    assert token.tolist() == [0, 7, 19_999]


def test_draws_over_a_long_vocabulary_are_uniform_across_columns() -> None:
    # Flat logits: every column (in every chunk, lane and slice of the kernel) equally likely.
    rows, vocab = 100_000, 20_000
    logits = torch.zeros(rows, vocab, dtype=torch.bfloat16, device="cuda")
    inv_t, seed, noisy = _scalars(7, 1.0, 1.0)
    out = (torch.empty(rows, dtype=torch.long, device="cuda"), torch.empty(rows, device="cuda"))
    token, logprob = race_draw(logits, inv_t, seed, noisy, out=out)
    assert token is out[0] and logprob is out[1]
    counts = torch.bincount(token // 500, minlength=40).float()  # 40 buckets of 500 columns
    chi2 = float(((counts - rows / 40) ** 2 / (rows / 40)).sum())
    assert chi2 < 80, (chi2, counts)  # 39 degrees of freedom: p < 1e-4 by chance
    torch.testing.assert_close(logprob, torch.full_like(logprob, -math.log(vocab)))


def test_rows_padded_apart_draw_as_contiguous_ones() -> None:
    # cuBLAS leaves a bf16 head's [rows, 20] output with rows 24 apart at some batch sizes.
    torch.manual_seed(0)
    padded = (torch.randn(1024, 24, device="cuda") * 3).bfloat16()
    logits = padded[:, :20]
    inv_t, seed, noisy = _scalars(5, 1.0, 1.0)
    token, logprob = race_draw(logits, inv_t, seed, noisy)
    again, again_logprob = race_draw(logits.contiguous(), inv_t, seed, noisy)
    assert torch.equal(token, again) and torch.equal(logprob, again_logprob)
    greedy, _ = race_draw(logits, inv_t, seed, torch.tensor(0.0, device="cuda"))
    assert torch.equal(greedy, logits.float().argmax(-1))
