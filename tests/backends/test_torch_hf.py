"""Checkpoint I/O against transformers for each family: logits parity both ways, exact round
trips, shards, clear errors."""

import json
import shutil
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from backends.torch.config import ModelConfig
from backends.torch.errors import ModelLoadError, UnsupportedModelError
from backends.torch.hf import WEIGHTS_FILE, load_pretrained, read_config, save_pretrained
from backends.torch.model import Decoder
from pipeline.shell.cli import main

TINY_HF = Path(__file__).parents[1] / "data" / "tiny-hf.yaml"

SHAPE = dict(
    vocab_size=61,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
ROPE = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "linear": {"rope_type": "linear", "factor": 2.0},
}


def _qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=True, rope_theta=1000.0))
    return _randomize(model)


def _llama(rope: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    # transformers adds keys to the rope dict it is given, so it gets a copy.
    config = LlamaConfig(**SHAPE, head_dim=24, tie_word_embeddings=False, rope_scaling=dict(ROPE[rope]))
    return _randomize(LlamaForCausalLM(config))


def _qwen3() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    # head_dim differs from hidden_size / heads (16), as in Qwen3-0.6B's 1024 / 16 = 64 vs 128.
    config = Qwen3Config(**SHAPE, head_dim=24, tie_word_embeddings=True, rope_theta=1000.0)
    return _randomize(Qwen3ForCausalLM(config))


def _mistral(window: int | None = None) -> MistralForCausalLM:
    torch.manual_seed(0)
    return _randomize(MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=window)))


BUILDERS = {
    "qwen2-tied-bias": _qwen2,
    "llama-llama3-rope": lambda: _llama("llama3"),
    "llama-linear-rope": lambda: _llama("linear"),
    "qwen3-qk-norm-tied": _qwen3,
    "mistral": _mistral,
    # A window as wide as the context never limits attention: loaded, with HF's logits.
    "mistral-window-at-context": lambda: _mistral(SHAPE["max_position_embeddings"]),
}


def _randomize(model: torch.nn.Module) -> torch.nn.Module:
    # Default init zeroes biases and sets norms to 1; perturb them so every tensor is tested.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    return ids, torch.arange(40).expand(2, 40)


def _hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _ours(model: Decoder, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, positions)


@pytest.mark.parametrize("build", BUILDERS.values(), ids=BUILDERS.keys())
def test_transformers_checkpoint_loads_with_matching_logits(build, tmp_path: Path) -> None:
    hf = build()
    hf.save_pretrained(tmp_path)
    config, model = load_pretrained(tmp_path)
    assert config.architecture == type(hf).__name__
    assert config.attention_bias == isinstance(hf, Qwen2ForCausalLM)
    assert config.qk_norm == isinstance(hf, Qwen3ForCausalLM)
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    ids, positions = _inputs()
    torch.testing.assert_close(_ours(model, ids, positions), _hf_logits(hf, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "config",
    [
        ModelConfig(**SHAPE, attention_bias=True, tie_word_embeddings=True),
        ModelConfig(**SHAPE, head_dim=24, rope_scaling=ROPE["linear"]),
        ModelConfig(**SHAPE, rope_theta=500.0, rope_scaling=ROPE["llama3"]),
        ModelConfig(**SHAPE, qk_norm=True, head_dim=24, tie_word_embeddings=True),
        ModelConfig(**SHAPE, hf_architecture="MistralForCausalLM"),
    ],
    ids=["qwen2", "llama-linear", "llama-llama3", "qwen3", "mistral"],
)
def test_our_checkpoint_loads_in_transformers(config: ModelConfig, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _randomize(Decoder(config))
    save_pretrained(config, model, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(hf).__name__ == config.architecture
    assert getattr(hf.config, "sliding_window", None) is None  # (MistralConfig's default is 4096)
    ids, positions = _inputs()
    torch.testing.assert_close(_hf_logits(hf, ids), _ours(model, ids, positions), atol=1e-4, rtol=0)
    reloaded_config, reloaded = load_pretrained(tmp_path)
    assert reloaded_config == config
    assert torch.equal(_ours(reloaded, ids, positions), _ours(model, ids, positions))


@pytest.mark.parametrize("build", BUILDERS.values(), ids=BUILDERS.keys())
def test_transformers_checkpoint_round_trips_exactly(build, tmp_path: Path) -> None:
    """Loaded and saved again: the same tensor names and values, a config that reads back the
    same, and transformers builds the same class with the same logits from it."""
    hf = build()
    hf.save_pretrained(tmp_path / "theirs")
    config, model = load_pretrained(tmp_path / "theirs")
    save_pretrained(config, model, tmp_path / "ours")
    theirs, ours = (load_file(tmp_path / d / WEIGHTS_FILE) for d in ("theirs", "ours"))
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    assert read_config(tmp_path / "ours") == config
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(again) is type(hf)
    ids, _ = _inputs()
    assert torch.equal(_hf_logits(again, ids), _hf_logits(hf, ids))


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    hf = _llama("llama3")
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    _, model = load_pretrained(tmp_path)
    ids, positions = _inputs()
    torch.testing.assert_close(_ours(model, ids, positions), _hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    _qwen2().save_pretrained(tmp_path, max_shard_size="50KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    index = tmp_path / "model.safetensors.index.json"
    with pytest.raises(ModelLoadError) as err:
        load_pretrained(tmp_path)
    assert str(err.value) == f"{index}: shard {shard.name} named by the index is missing"


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"]}))
    with pytest.raises(UnsupportedModelError) as err:
        load_pretrained(tmp_path)
    assert isinstance(err.value, ModelLoadError)
    assert str(err.value) == (
        f"{tmp_path / 'config.json'}: unsupported architecture 'Qwen3MoeForCausalLM'; "
        "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"
    )


def test_mistral_sliding_window_that_limits_attention_is_refused(tmp_path: Path) -> None:
    _mistral(window=16).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError) as err:
        load_pretrained(tmp_path)
    assert str(err.value) == (
        f"{tmp_path / 'config.json'}: MistralForCausalLM with sliding_window=16 (attention over "
        "only the last 16 positions, fewer than max_position_embeddings=128) is not supported"
    )


def _without(config: dict, key: str) -> dict:
    return {k: v for k, v in config.items() if k != key}


@pytest.mark.parametrize(
    ("arch", "config", "feature"),
    [
        # transformers reads a Mistral config.json without the key as a window of 4096.
        (
            "MistralForCausalLM",
            _without(MistralConfig(**SHAPE | {"max_position_embeddings": 32768}).to_dict(), "sliding_window"),
            "sliding_window=4096 (attention over only the last 4096 positions, fewer than "
            "max_position_embeddings=32768)",
        ),
        ("Qwen3ForCausalLM", Qwen3Config(**SHAPE, attention_bias=True).to_dict(), "attention_bias=true"),
        (
            "Qwen3ForCausalLM",
            Qwen3Config(**SHAPE, use_sliding_window=True).to_dict(),
            "use_sliding_window=true",
        ),
    ],
    ids=["mistral-default-window", "qwen3-attention-bias", "qwen3-sliding-window"],
)
def test_unsupported_family_features_are_named(arch: str, config: dict, feature: str) -> None:
    with pytest.raises(UnsupportedModelError) as err:
        ModelConfig.from_hf_dict(config | {"architectures": [arch]}, source="m/config.json")
    assert str(err.value) == f"m/config.json: {arch} with {feature} is not supported"


def test_a_config_json_whose_heads_do_not_divide_is_a_recipe_error_at_validate(
    tiny_qwen2_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """num_key_value_heads that does not divide num_attention_heads in a model's config.json:
    `validate` exits 2 with one line naming the file and both fields, not a traceback."""
    model = tmp_path / "model"
    shutil.copytree(tiny_qwen2_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"num_key_value_heads": 3}))
    with pytest.raises(ModelLoadError) as err:
        read_config(model)
    expected = (
        f"{model / 'config.json'}: num_attention_heads ({config['num_attention_heads']}) must be a "
        "multiple of num_key_value_heads (3)"
    )
    assert str(err.value) == expected
    data = tmp_path / "math.jsonl"
    data.write_text(json.dumps({"prompt": "What is 3 + 4?", "answer": "7"}) + "\n")
    overrides = [f"model.path={model}", f"prompts.source.path={data}", f"run.dir={tmp_path / 'run'}"]
    assert main(["validate", str(TINY_HF), *overrides]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"error: model.path: {expected}"


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"missing config\.json$"):
        load_pretrained(tmp_path)
    config = ModelConfig(vocab_size=8, hidden_size=16, intermediate_size=16)
    save_pretrained(config, Decoder(config), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(
        ModelLoadError, match=r"missing model\.safetensors \(and no model\.safetensors\.index\.json\)$"
    ):
        load_pretrained(tmp_path)


def test_mismatched_tensor_names_are_listed(tmp_path: Path) -> None:
    small = ModelConfig(vocab_size=8, hidden_size=16, intermediate_size=16, num_hidden_layers=1)
    save_pretrained(small, Decoder(small), tmp_path)
    bigger = msgspec.structs.replace(small, num_hidden_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(bigger.to_hf_dict()))
    with pytest.raises(
        ModelLoadError, match=r"missing model\.layers\.1\.input_layernorm\.weight, .*; unexpected none$"
    ):
        load_pretrained(tmp_path)
    tied = msgspec.structs.replace(small, tie_word_embeddings=True)
    save_pretrained(tied, Decoder(tied), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(small.to_hf_dict()))
    with pytest.raises(ModelLoadError, match=r"missing lm_head\.weight; unexpected none$"):
        load_pretrained(tmp_path)
