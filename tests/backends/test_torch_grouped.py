"""Group-shared prompt logprobs equal full-sequence recomputation, values and gradients."""

from __future__ import annotations

import pytest
import torch

from backends.torch.config import ModelConfig
from backends.torch.grouped import response_logprobs
from backends.torch.model import Decoder, token_logprobs


def _full(model: Decoder, prompts, owner, responses, temperature):
    seqs = [list(prompts[o]) + list(r) for o, r in zip(owner, responses, strict=True)]
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    lp = token_logprobs(model, ids, attention, temperature)
    longest = max(len(r) for r in responses)
    rows = []
    for o, r, row in zip(owner, responses, lp, strict=True):
        start = len(prompts[o]) - 1
        rows.append(torch.cat([row[start : start + len(r)], row.new_zeros(longest - len(r))]))
    return torch.stack(rows)


@pytest.mark.parametrize("learned_positions", [False, True], ids=["rotary", "rotary+learned"])
def test_grouped_logprobs_and_gradients_match_full_sequences(learned_positions: bool) -> None:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=23,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        learned_position_embeddings=learned_positions,
    )
    model = Decoder(config)
    prompts = [(2, 5, 7, 9), (2, 11), (3, 4, 5, 6, 7, 8)]
    owner = [0, 0, 0, 1, 1, 2, 2, 2]
    responses = [(4,), (5, 6, 1), (7, 8, 9, 10), (12, 13), (14,), (3, 3, 3), (1,), (9, 8)]
    grouped, mask = response_logprobs(model, prompts, owner, responses, 0.7)
    (grouped * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    full = _full(model, prompts, owner, responses, 0.7)
    (full * mask).sum().backward()
    assert mask.sum() == sum(len(r) for r in responses)
    torch.testing.assert_close(grouped, full, atol=1e-5, rtol=0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize(
    "options", [{"compiled": True}, {"checkpointed": True}], ids=["compiled", "checkpointed"]
)
def test_compiled_and_checkpointed_layers_give_the_same_logprobs_and_gradients(options: dict) -> None:
    torch.manual_seed(0)
    model = Decoder(ModelConfig(vocab_size=23, hidden_size=64, intermediate_size=96, num_attention_heads=4))
    prompts = [(2, 5, 7, 9), (3, 11)]
    owner, responses = [0, 0, 1, 1], [(4, 1), (5, 6, 1), (12, 13), (14,)]

    def run(**kw: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        lp, mask = response_logprobs(model, prompts, owner, responses, 0.7, **kw)
        (lp * mask).sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    plain, plain_grads = run()
    ours, grads = run(**options)
    torch.testing.assert_close(ours, plain, atol=1e-5, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("padded", [False, True], ids=["equal-prompts", "padded-prompts"])
def test_one_token_responses_only(padded: bool) -> None:
    """Every response a single token (max_new_tokens 1, or an immediate stop): no suffix pass."""
    torch.manual_seed(0)
    model = Decoder(ModelConfig(vocab_size=23, hidden_size=64, intermediate_size=96))
    prompts = [(2, 5, 7), (3, 11, 4)] if not padded else [(2, 5, 7), (11,)]
    owner, responses = [0, 0, 1], [(4,), (9,), (1,)]
    grouped, mask = response_logprobs(model, prompts, owner, responses, 1.0)
    assert grouped.shape == (3, 1) and mask.sum() == 3
    torch.testing.assert_close(grouped, _full(model, prompts, owner, responses, 1.0), atol=1e-5, rtol=0)


def test_float32_residual_keeps_bf16_layers_and_matches_the_sampler() -> None:
    """`model.residual: float32`: the residual stream is float32, every norm output and
    projection stays bf16, and the engine and the trainer still compute the same logprobs."""
    from backends.torch.engine import Sampler

    torch.manual_seed(0)
    model = Decoder(ModelConfig(vocab_size=23, hidden_size=64, intermediate_size=96)).to(torch.bfloat16)
    ids = torch.tensor([[2, 5, 7, 9]])
    positions = torch.arange(4).unsqueeze(0)
    plain = model.hidden_states(ids, positions)
    model.residual_dtype = torch.float32
    assert model.embed(ids, positions).dtype == torch.float32
    wide = model.hidden_states(ids, positions)
    assert wide.dtype == torch.bfloat16
    assert not torch.equal(wide, plain)  # the layers' sums were not rounded to bf16
    torch.testing.assert_close(wide, plain, atol=0.1, rtol=0.05)
    prompts = [[2, 5, 7, 9], [2, 11]]
    out = Sampler(model).generate(
        [prompts[0]] * 3 + [prompts[1]] * 2, max_new_tokens=6, temperature=1.0, generator=torch.Generator()
    )
    with torch.no_grad():
        lp, mask = response_logprobs(model, prompts, [0, 0, 0, 1, 1], [o.tokens for o in out], 1.0)
    gen = torch.zeros_like(lp)
    for i, o in enumerate(out):
        gen[i, : len(o.logprobs)] = torch.tensor(o.logprobs)
    torch.testing.assert_close(lp * mask, gen, atol=0.02, rtol=0)


def test_recipe_residual_field_reaches_the_model() -> None:
    from backends.torch.build import build_model
    from backends.torch.section import ModelSection

    config = ModelConfig(vocab_size=23, hidden_size=64, intermediate_size=96)
    assert build_model(ModelSection(config=config), vocab_size=23, seed=0).residual_dtype is None
    section = ModelSection(config=config, residual="float32")
    assert build_model(section, vocab_size=23, seed=0).residual_dtype == torch.float32
