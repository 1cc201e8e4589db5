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


@pytest.mark.parametrize(
    "variant",
    [{}, {"learned_position_embeddings": True}, {"qk_norm": True, "head_dim": 24}],
    ids=["rotary", "rotary+learned", "qwen3"],
)
def test_grouped_logprobs_and_gradients_match_full_sequences(variant: dict) -> None:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=23, hidden_size=64, intermediate_size=96, num_attention_heads=4, **variant
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
    from backends.torch.sampler import Sampler

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
    groups = Sampler(model).generate(
        [(prompts[0], 3), (prompts[1], 2)], max_new_tokens=6, temperature=1.0, generator=torch.Generator()
    )
    out = [o for group in groups for o in group]
    with torch.no_grad():
        lp, mask = response_logprobs(model, prompts, [0, 0, 0, 1, 1], [o.tokens for o in out], 1.0)
    gen = torch.zeros_like(lp)
    for i, o in enumerate(out):
        gen[i, : len(o.logprobs)] = torch.tensor(o.logprobs)
    torch.testing.assert_close(lp * mask, gen, atol=0.02, rtol=0)


def test_flash_is_chosen_on_cuda_for_half_precision_layers_only() -> None:
    from backends.torch.grouped import _flash_usable

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert _flash_usable(cuda, torch.bfloat16) and _flash_usable(cuda, torch.float16)
    assert not _flash_usable(cuda, torch.float32)
    assert not _flash_usable(cpu, torch.bfloat16)


def test_a_float32_residual_asks_for_flash_by_the_layers_dtype(monkeypatch) -> None:
    """`model.residual: float32` (the H200 recipes') keeps bf16 layers: the pass asks for the
    responses' flash attention by their dtype, not the float32 residual stream's. Asked by the
    stream's, a GPU pass fell back to SDPA over the responses padded to the longest, which on
    long-tailed lengths cost most of a training step."""
    from backends.torch import grouped

    asked: list[tuple[torch.device, torch.dtype]] = []
    monkeypatch.setattr(grouped, "_flash_usable", lambda *where: asked.append(where) or False)
    torch.manual_seed(0)
    model = Decoder(ModelConfig(vocab_size=23, hidden_size=64, intermediate_size=96)).to(torch.bfloat16)
    model.residual_dtype = torch.float32
    with torch.no_grad():
        response_logprobs(model, [(2, 5, 7)], [0, 0], [(4, 6, 1), (3,)], 1.0)
    assert asked == [(torch.device("cpu"), torch.bfloat16)]


def test_recipe_residual_field_reaches_the_model() -> None:
    from backends.torch.build import build_model
    from backends.torch.section import ModelSection

    config = ModelConfig(vocab_size=23, hidden_size=64, intermediate_size=96)
    assert build_model(ModelSection(config=config), vocab_size=23, seed=0).residual_dtype is None
    section = ModelSection(config=config, residual="float32")
    assert build_model(section, vocab_size=23, seed=0).residual_dtype == torch.float32


def _varlen_causal_attention(q, k, v, layout):
    """Flash's variable-length attention written out: per row, keys cu_k[i]:cu_k[i+1], causal
    aligned bottom-right, query heads grouped over the key/value heads."""
    keys, values = k.index_select(0, layout.keys), v.index_select(0, layout.keys)
    group = q.shape[1] // k.shape[1]
    out = []
    for i in range(layout.cu_q.numel() - 1):
        qi = q[layout.cu_q[i] : layout.cu_q[i + 1]].transpose(0, 1)  # [heads, S, D]
        ki = keys[layout.cu_k[i] : layout.cu_k[i + 1]].transpose(0, 1).repeat_interleave(group, 0)
        vi = values[layout.cu_k[i] : layout.cu_k[i + 1]].transpose(0, 1).repeat_interleave(group, 0)
        s, t = qi.shape[1], ki.shape[1]
        allowed = torch.ones(s, t, dtype=torch.bool).tril(t - s)
        out.append(
            torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=allowed).transpose(0, 1)
        )
    return torch.cat(out)


def test_flash_layout_of_the_responses_attention_matches_the_masked_one(monkeypatch) -> None:
    """The GPU's variable-length layout (each row: its prompt's real keys, then its own) gives
    the masked SDPA path's logprobs and gradients; here flash's kernel is written out."""
    from backends.torch import grouped

    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=23, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2
    )
    model = Decoder(config)
    prompts = [(2, 5, 7, 9), (2, 11), (3, 4, 5, 6, 7, 8)]  # left-padded to 6
    owner = [0, 0, 1, 2, 2]
    responses = [(4,), (5, 6, 1), (12, 13), (3, 3, 3, 4), (1,)]

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        lp, mask = response_logprobs(model, prompts, owner, responses, 0.7)
        (lp * mask).sum().backward()
        return lp.detach(), [p.grad.clone() for p in model.parameters()]

    masked, masked_grads = run()
    monkeypatch.setattr(grouped, "_flash_usable", lambda *a: True)
    monkeypatch.setattr(grouped, "_flash_attend", _varlen_causal_attention)
    flash, flash_grads = run()
    torch.testing.assert_close(flash, masked, atol=1e-5, rtol=0)
    for ours, reference in zip(flash_grads, masked_grads, strict=True):
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("flash", [False, True], ids=["masked", "flash-layout"])
def test_packed_long_tailed_responses_give_the_padded_logprobs_loss_and_gradients(flash, monkeypatch) -> None:
    """Responses of very different lengths (one of 40 tokens beside ones of 1-5), packed at
    their own lengths, give the logprobs, a weighted loss and its gradients of the full
    sequences padded to the longest (float32). With ``flash`` the GPU's variable-length layout
    over the packed inputs runs, flash's kernel written out."""
    from backends.torch import grouped

    if flash:
        monkeypatch.setattr(grouped, "_flash_usable", lambda *a: True)
        monkeypatch.setattr(grouped, "_flash_attend", _varlen_causal_attention)
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=23, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2
    )
    model = Decoder(config)
    prompts = [(2, 5, 7, 9), (3, 11)]
    owner = [0, 0, 0, 1, 1, 1]
    lengths = [1, 40, 3, 5, 2, 1]
    responses = [tuple((3 * i + j) % 23 for j in range(n)) for i, n in enumerate(lengths)]
    weights = torch.linspace(-1.0, 1.0, len(responses))[:, None]

    def loss(lp: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        value = (lp * mask * weights).sum() / mask.sum()
        value.backward()
        return value.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    packed, mask = response_logprobs(model, prompts, owner, responses, 0.7)
    assert packed.shape == (6, 40) and mask.sum(1).tolist() == lengths
    packed_loss, packed_grads = loss(packed, mask)
    full = _full(model, prompts, owner, responses, 0.7)
    full_loss, full_grads = loss(full, mask)
    torch.testing.assert_close(packed.detach(), full.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(packed_loss, full_loss, atol=1e-6, rtol=0)
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, full_grads[name], atol=1e-5, rtol=1e-4, msg=name)
