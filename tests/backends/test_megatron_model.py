"""A megatron-core GPTModel of a ModelConfig computes what the torch Decoder computes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from backends.megatron import layout, parallel  # noqa: E402
from backends.megatron.model import build_gpt_model  # noqa: E402
from backends.torch.model import Decoder  # noqa: E402
from tests.backends.megatron_cases import CONFIGS  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def _groups() -> None:
    parallel.initialise(device=CPU)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_same_logits_as_the_torch_decoder(name: str) -> None:
    config = CONFIGS[name]
    torch.manual_seed(0)
    decoder = Decoder(config)
    model = build_gpt_model(config, dtype=torch.float32, device=CPU)
    layout.load_hf(model, decoder.state_dict(), config)
    ids = torch.randint(0, config.vocab_size, (3, 20))
    positions = torch.arange(20).expand(3, 20)
    expected = decoder(ids, positions)
    got = model(ids, positions, attention_mask=None)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert expected.std() > 0.1  # weights that matter, not a degenerate comparison


def test_every_megatron_parameter_must_be_given() -> None:
    config = CONFIGS["learned-positions"]
    model = build_gpt_model(config, dtype=torch.float32, device=CPU)
    state = Decoder(config).state_dict()
    del state["model.embed_positions.weight"]
    with pytest.raises(ValueError, match=r"\['embedding.position_embeddings.weight'\] do not match"):
        layout.load_hf(model, state, config)


@pytest.mark.parametrize("name", ["qwen3-qk-norm-tied", "qwen2-bias"])
def test_every_parameter_has_the_model_dtype(name: str) -> None:
    """The local spec builds its RMSNorms in float32 whatever `params_dtype` says; the engine's
    Decoder holds them in the model dtype, so a bf16 policy must too (else the wake's fingerprints
    differ and the norms train at a precision the engine never serves)."""
    model = build_gpt_model(CONFIGS[name], dtype=torch.bfloat16, device=CPU)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
