"""Architecture hyper-parameters of a Llama/Mistral/Qwen2/Qwen3-family decoder.

`ModelConfig` doubles as the ``model:`` section of YAML recipes, so its defaults describe
a tiny model suitable for CPU runs; only ``vocab_size`` is required. Field names follow
Hugging Face ``config.json`` so that checkpoints map onto it one to one.
"""

from typing import Annotated, Any, Literal

import msgspec

from backends.torch.errors import ModelLoadError, UnsupportedModelError

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]

# Keys each supported rope_scaling type needs (beyond "rope_type").
_ROPE_SCALING_KEYS: dict[str, frozenset[str]] = {
    "linear": frozenset({"factor"}),
    "llama3": frozenset(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
}

# Hugging Face class -> its model_type. Mistral's parameter layout is Llama's.
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# What transformers' MistralConfig reads a config.json without "sliding_window" as.
_MISTRAL_DEFAULT_WINDOW = 4096


class ModelConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Shape and numerics of a decoder-only transformer.

    Contract:
      * ``head_dim`` left as None is resolved to ``hidden_size // num_attention_heads`` on
        construction, so readers always see an int.
      * ``num_attention_heads`` is a multiple of ``num_key_value_heads`` (grouped-query attention)
        and ``head_dim`` is even (rotary embeddings rotate pairs).
      * ``attention_bias`` adds biases to the q/k/v projections only (the Qwen2 layout).
      * ``qk_norm`` RMS-normalises each head's queries and keys over ``head_dim`` before the
        rotation, one weight shared by the heads (the Qwen3 layout); not with ``attention_bias``.
      * `architecture`, the Hugging Face class of this layout (what `to_hf_dict` writes), is
        Qwen3 with ``qk_norm``, Qwen2 with ``attention_bias``, else Llama, or Mistral where
        ``hf_architecture`` says so (the Llama layout under Mistral's name).
      * ``rope_scaling`` is None or ``{"rope_type": "linear", "factor": f}`` or
        ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
        "original_max_position_embeddings"}`` with the meaning transformers gives them.
    Invalid combinations raise ValueError (msgspec.ValidationError when decoding).
    """

    vocab_size: PositiveInt
    hidden_size: PositiveInt = 128
    intermediate_size: PositiveInt = 256
    num_hidden_layers: PositiveInt = 2
    num_attention_heads: PositiveInt = 4
    num_key_value_heads: PositiveInt = 2
    head_dim: PositiveInt | None = None
    max_position_embeddings: PositiveInt = 2048
    rope_theta: PositiveFloat = 10000.0
    rms_norm_eps: PositiveFloat = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    hf_architecture: Literal["MistralForCausalLM"] | None = None
    rope_scaling: dict[str, Any] | None = None
    # Not a feature of these Hugging Face families: a learned absolute position embedding added
    # to the token embedding (rotary stays). Small models from scratch learn position-dependent
    # tasks (reversal) far faster with it. Such a model has no Hugging Face equivalent.
    learned_position_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        head_dim = self.head_dim
        if head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                    f"({self.num_attention_heads}) when head_dim is not given"
                )
            head_dim = self.hidden_size // self.num_attention_heads
            msgspec.structs.force_setattr(self, "head_dim", head_dim)
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
        if self.attention_bias and self.qk_norm:
            raise ValueError(
                "attention_bias and qk_norm together have no Hugging Face equivalent "
                "(Qwen3's attention_bias also biases o_proj)"
            )
        if self.hf_architecture is not None and (self.attention_bias or self.qk_norm):
            raise ValueError(
                f"hf_architecture {self.hf_architecture} names the Llama layout: "
                "it takes neither attention_bias nor qk_norm"
            )
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling)
            # A private copy: the caller's dict may be mutated later (transformers does so).
            msgspec.structs.force_setattr(self, "rope_scaling", dict(self.rope_scaling))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], *, source: str = "config.json") -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout).

        Raises UnsupportedModelError, naming ``source``, for architectures other than
        Llama/Mistral/Qwen2/Qwen3ForCausalLM and for features this backend does not implement:
        among them a Mistral sliding window narrower than ``max_position_embeddings`` (a window
        at least that wide never limits attention within the model's context); ModelLoadError,
        naming ``source``, for values that break the contract above (``num_key_value_heads``
        not dividing ``num_attention_heads``, an odd ``head_dim``, ...).
        """
        architectures = d.get("architectures") or []
        # A tuple keeps odd values hashable for the lookup and readable in the message.
        arch = architectures[0] if len(architectures) == 1 else tuple(architectures)
        if arch not in _ARCHITECTURES:
            raise UnsupportedModelError(
                f"{source}: unsupported architecture {arch!r}; supported: {', '.join(_ARCHITECTURES)}"
            )

        def unsupported(feature: str) -> UnsupportedModelError:
            return UnsupportedModelError(f"{source}: {arch} with {feature} is not supported")

        if d.get("hidden_act", "silu") != "silu":
            raise unsupported(f"hidden_act={d['hidden_act']!r}")
        if d.get("mlp_bias"):
            raise unsupported("mlp_bias=true")
        if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and d.get("attention_bias"):
            # Their attention_bias also biases o_proj, which this backend does not model.
            raise unsupported("attention_bias=true")
        if d.get("use_sliding_window"):
            raise unsupported("use_sliding_window=true")
        if arch == "MistralForCausalLM":
            window = d.get("sliding_window", _MISTRAL_DEFAULT_WINDOW)
            if window is not None and window < d.get("max_position_embeddings", 0):
                raise unsupported(
                    f"sliding_window={window} (attention over only the last {window} positions, "
                    f"fewer than max_position_embeddings={d['max_position_embeddings']})"
                )

        # transformers 5 nests rope_theta and the scaling spec in "rope_parameters";
        # 4.x keeps "rope_theta" top level and the spec in "rope_scaling".
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", None) or d.get("rope_theta", 10000.0)
        if rope.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) != 1.0:
            raise unsupported("partial_rotary_factor != 1")
        rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
        rope.pop("type", None)
        rope_scaling: dict[str, Any] | None = None
        if rope_type != "default":
            if rope_type not in _ROPE_SCALING_KEYS:
                raise unsupported(f"rope type {rope_type!r}")
            if rope_type == "llama3":
                rope.setdefault("original_max_position_embeddings", d["max_position_embeddings"])
            rope_scaling = {"rope_type": rope_type} | {
                k: rope[k] for k in _ROPE_SCALING_KEYS[rope_type] if k in rope
            }

        hidden_size = d["hidden_size"]
        heads = d["num_attention_heads"]
        try:
            return cls(
                vocab_size=d["vocab_size"],
                hidden_size=hidden_size,
                intermediate_size=d["intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=d.get("num_key_value_heads") or heads,
                head_dim=d.get("head_dim") or hidden_size // heads,
                max_position_embeddings=d["max_position_embeddings"],
                rope_theta=float(rope_theta),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases, whatever the file says; Qwen3 always q/k norms.
                attention_bias=arch == "Qwen2ForCausalLM",
                qk_norm=arch == "Qwen3ForCausalLM",
                hf_architecture="MistralForCausalLM" if arch == "MistralForCausalLM" else None,
                rope_scaling=rope_scaling,
            )
        except KeyError as exc:
            raise UnsupportedModelError(f"{source}: missing required key {exc.args[0]!r}") from None
        except ValueError as exc:  # values that break the contract (heads that do not divide ...)
            raise ModelLoadError(f"{source}: {exc}") from None

    @property
    def position_limit(self) -> int | None:
        """The most positions a sequence may use: the learned table's size, or None (rotary)."""
        return self.max_position_embeddings if self.learned_position_embeddings else None

    @property
    def architecture(self) -> str:
        """Hugging Face class that has exactly this parameter layout."""
        if self.qk_norm:
            return "Qwen3ForCausalLM"
        if self.attention_bias:
            return "Qwen2ForCausalLM"
        return self.hf_architecture or "LlamaForCausalLM"

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` dict that transformers (4.x and 5.x) loads as ``architecture``."""
        if self.learned_position_embeddings:
            raise UnsupportedModelError(
                "learned_position_embeddings=true has no Hugging Face Llama/Qwen2 equivalent; "
                "such a model cannot be exported"
            )
        rope_parameters = {"rope_type": "default", **(self.rope_scaling or {})}
        # Mistral without the key would get transformers' default window.
        window = {"sliding_window": None} if self.architecture == "MistralForCausalLM" else {}
        return {
            "architectures": [self.architecture],
            "model_type": _ARCHITECTURES[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rope_parameters": {**rope_parameters, "rope_theta": self.rope_theta},
        } | window


def _check_rope_scaling(spec: dict[str, Any]) -> None:
    rope_type = spec.get("rope_type")
    if rope_type not in _ROPE_SCALING_KEYS:
        raise UnsupportedModelError(
            f"rope_scaling.rope_type must be one of {sorted(_ROPE_SCALING_KEYS)}, got {rope_type!r}"
        )
    need = _ROPE_SCALING_KEYS[rope_type]
    keys = set(spec) - {"rope_type"}
    if keys != need:
        raise ValueError(f"rope_scaling of type {rope_type!r} needs keys {sorted(need)}, got {sorted(keys)}")
    for key in need:
        value = spec[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"rope_scaling.{key} must be a positive number, got {value!r}")
    if rope_type == "llama3" and spec["high_freq_factor"] <= spec["low_freq_factor"]:
        raise ValueError("rope_scaling.high_freq_factor must exceed low_freq_factor")
