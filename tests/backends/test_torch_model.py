"""Decoder numerics and parameters: `token_logprobs`, tied and fused tensors, configs."""

import msgspec
import pytest
import torch

from backends.torch.config import ModelConfig
from backends.torch.errors import UnsupportedModelError
from backends.torch.model import Decoder, token_logprobs

CONFIG = ModelConfig(vocab_size=37, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)


def _model(config: ModelConfig = CONFIG, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    model = Decoder(config)
    # Non-zero biases and norms so that every parameter matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "norm.weight", "layernorm.weight")):
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return model


def _positions(b: int, t: int) -> torch.Tensor:
    return torch.arange(t).expand(b, t)


def test_token_logprobs_matches_log_softmax_on_right_padded_batch() -> None:
    model = _model()
    gen = torch.Generator().manual_seed(3)
    lengths = [9, 4, 6]
    ids = torch.full((3, 9), -100)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(0, 37, (n,), generator=gen)
    mask = ids != -100
    got = token_logprobs(model, ids, mask.int(), temperature=0.7)
    assert got.shape == (3, 8) and got.dtype == torch.float32
    for i, n in enumerate(lengths):
        row = ids[i, :n]
        logp = torch.log_softmax(model(row[None], _positions(1, n))[0] / 0.7, dim=-1)
        want = logp[:-1].gather(-1, row[1:, None]).squeeze(-1)
        torch.testing.assert_close(got[i, : n - 1], want, atol=1e-5, rtol=0)
        assert torch.all(got[i, n - 1 :] == 0)


def test_token_logprobs_is_differentiable() -> None:
    model = _model()
    ids = torch.randint(0, 37, (2, 6), generator=torch.Generator().manual_seed(4))
    token_logprobs(model, ids, torch.ones(2, 6, dtype=torch.bool)).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_token_logprobs_rejects_left_padding() -> None:
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="right-padded"):
        token_logprobs(_model(), ids, torch.tensor([[0, 1, 1, 1]]))


def test_tied_embeddings_share_one_tensor() -> None:
    model = Decoder(msgspec.structs.replace(CONFIG, tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" in model.state_dict()


def test_state_dict_names_follow_hugging_face() -> None:
    names = set(
        Decoder(msgspec.structs.replace(CONFIG, num_hidden_layers=1, attention_bias=True)).state_dict()
    )
    attn = "model.layers.0.self_attn"
    assert names == {
        "model.embed_tokens.weight",
        *(f"{attn}.{p}_proj.weight" for p in "qkvo"),
        *(f"{attn}.{p}_proj.bias" for p in "qkv"),
        *(f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    }


def test_fused_projections_are_parameters_and_state_dicts_round_trip_exactly() -> None:
    """q/k/v and gate/up are one Parameter each (one GEMM on every path, what the optimizer
    steps), stored under Hugging Face's names: a state dict loads back bit for bit, into a
    model whose fused tensors are the parts stacked in order."""
    config = msgspec.structs.replace(CONFIG, num_hidden_layers=1, attention_bias=True)
    source, target = _model(config, seed=0), _model(config, seed=1)
    assert {n for n, _ in source.named_parameters() if ".layers." in n} == {
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.self_attn.qkv_proj.bias",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
    }
    state = source.state_dict()
    target.load_state_dict(state)
    for name, tensor in target.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    qkv = torch.cat([state[f"{attn}.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(target.model.layers[0].self_attn.qkv_proj.weight, qkv)
    gate_up = torch.cat([state[f"{mlp}.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(target.model.layers[0].mlp.gate_up_proj.weight, gate_up)


def test_config_decodes_from_recipe_with_tiny_defaults() -> None:
    config = msgspec.json.decode(b'{"vocab_size": 16}', type=ModelConfig)
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (128, 2, 32)
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.json.decode(b'{"vocab_size": 16, "hiden_size": 8}', type=ModelConfig)
    with pytest.raises(msgspec.ValidationError, match="multiple of num_key_value_heads"):
        msgspec.json.decode(b'{"vocab_size": 16, "num_key_value_heads": 3}', type=ModelConfig)
    with pytest.raises(msgspec.ValidationError, match=">= 1"):
        msgspec.json.decode(b'{"vocab_size": 0}', type=ModelConfig)
    with pytest.raises(UnsupportedModelError, match="rope_type must be one of"):
        ModelConfig(vocab_size=16, rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="needs keys"):
        ModelConfig(vocab_size=16, rope_scaling={"rope_type": "linear"})


def test_config_names_the_hf_class_of_its_layout() -> None:
    assert ModelConfig(vocab_size=16).architecture == "LlamaForCausalLM"
    assert ModelConfig(vocab_size=16, attention_bias=True).architecture == "Qwen2ForCausalLM"
    assert ModelConfig(vocab_size=16, qk_norm=True).architecture == "Qwen3ForCausalLM"
    mistral = ModelConfig(vocab_size=16, hf_architecture="MistralForCausalLM")
    assert mistral.architecture == "MistralForCausalLM"
    for fields, message in [
        (
            b'"qk_norm": true, "attention_bias": true',
            "attention_bias and qk_norm together have no Hugging Face equivalent "
            "(Qwen3's attention_bias also biases o_proj)",
        ),
        (
            b'"hf_architecture": "MistralForCausalLM", "qk_norm": true',
            "hf_architecture MistralForCausalLM names the Llama layout: "
            "it takes neither attention_bias nor qk_norm",
        ),
    ]:
        with pytest.raises(msgspec.ValidationError) as err:
            msgspec.json.decode(b'{"vocab_size": 16, ' + fields + b"}", type=ModelConfig)
        assert str(err.value) == message


def test_from_hf_dict_rejects_unsupported_architecture() -> None:
    with pytest.raises(
        UnsupportedModelError,
        match=r"^x/config\.json: unsupported architecture 'GPT2LMHeadModel'; "
        r"supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM$",
    ):
        ModelConfig.from_hf_dict({"architectures": ["GPT2LMHeadModel"]}, source="x/config.json")


def test_learned_position_embeddings_change_the_output_and_cannot_be_exported() -> None:
    config = msgspec.structs.replace(CONFIG, learned_position_embeddings=True)
    model = _model(config)
    assert model.model.embed_positions.weight.shape == (config.max_position_embeddings, 64)
    ids = torch.tensor([[3, 3, 3, 3]])
    with torch.no_grad():
        model.model.embed_positions.weight.normal_(0, 1.0)
        hidden = model.hidden_states(ids, _positions(1, 4))
    assert not torch.allclose(hidden[0, 0], hidden[0, 1])  # same token, different positions
    with pytest.raises(UnsupportedModelError, match="no Hugging Face Llama/Qwen2 equivalent"):
        config.to_hf_dict()
