"""Reading and writing Hugging Face checkpoint directories (config.json + safetensors)."""

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from backends.torch.config import ModelConfig
from backends.torch.errors import ModelLoadError
from backends.torch.model import Decoder
from pipeline.contracts.text import NotText, read_text

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Older checkpoints store rotary tables; this model derives them from the config.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_LISTED_NAMES = 10


def read_config(root: Path) -> ModelConfig:
    """The `ModelConfig` of a Hugging Face directory's config.json (ModelLoadError naming the
    file when it is missing, not JSON or not a supported model)."""
    config_path = root / CONFIG_FILE
    if not config_path.is_file():
        raise ModelLoadError(f"{root}: missing {CONFIG_FILE}")
    try:
        raw = json.loads(read_text(config_path))
    except NotText as exc:
        raise ModelLoadError(str(exc)) from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_path}: invalid JSON ({exc})") from None
    return ModelConfig.from_hf_dict(raw, source=str(config_path))


def load_pretrained(
    path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[ModelConfig, Decoder]:
    """Load a Llama/Mistral/Qwen2/Qwen3ForCausalLM directory into a `Decoder`.

    Reads ``config.json`` and either ``model.safetensors`` or ``model.safetensors.index.json``
    plus the shards it names; tensors are streamed into the model one at a time. Raises
    ModelLoadError (UnsupportedModelError for unsupported architectures or features) naming
    the offending file, shard or tensor names.
    """
    root = Path(path)
    config = read_config(root)

    files = _weight_files(root)
    with torch.device(device):
        model = Decoder(config).to(dtype)
    # The state dict's tensors are the parameters' storage (the fused projections' rows as
    # views), so copying into them loads the model.
    params = model.state_dict()
    if config.tie_word_embeddings:
        del params["lm_head.weight"]  # the embedding itself
    found: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue  # some tied checkpoints keep a copy; the embedding is authoritative
                found[name] = file
    missing = sorted(params.keys() - found.keys())
    unexpected = sorted(found.keys() - params.keys())
    if missing or unexpected:
        raise ModelLoadError(
            f"{root}: checkpoint tensors do not match {config.architecture}: "
            f"missing {_listing(missing)}; unexpected {_listing(unexpected)}"
        )

    with torch.no_grad():
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if found.get(name) != file:
                        continue
                    tensor = f.get_tensor(name)
                    param = params[name]
                    if tensor.shape != param.shape:
                        raise ModelLoadError(
                            f"{file}: tensor {name} has shape {list(tensor.shape)}, "
                            f"config expects {list(param.shape)}"
                        )
                    param.copy_(tensor)
    return config, model


def save_pretrained(config: ModelConfig, model: Decoder, out_dir: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` that transformers loads as-is.

    A tied output projection is stored once, as ``model.embed_tokens.weight``, which is
    what transformers expects. ``config`` must be the model's own config.
    """
    if model.config != config:
        raise ValueError("config does not describe this model")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Copies: safetensors refuses tensors that share storage, as the fused projections' parts do.
    tensors = {name: t.to("cpu", copy=True) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        del tensors["lm_head.weight"]
    dtype = next(iter(tensors.values())).dtype
    hf_config = config.to_hf_dict() | {"torch_dtype": str(dtype).removeprefix("torch.")}
    (out / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    save_file(tensors, out / WEIGHTS_FILE, metadata={"format": "pt"})


def _weight_files(root: Path) -> list[Path]:
    single = root / WEIGHTS_FILE
    if single.is_file():
        return [single]
    index_path = root / INDEX_FILE
    if not index_path.is_file():
        raise ModelLoadError(f"{root}: missing {WEIGHTS_FILE} (and no {INDEX_FILE})")
    try:
        weight_map = json.loads(read_text(index_path))["weight_map"]
    except NotText as exc:
        raise ModelLoadError(str(exc)) from None
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{index_path}: not a safetensors index ({exc!r})") from None
    shards = [root / name for name in sorted(set(weight_map.values()))]
    for shard in shards:
        if not shard.is_file():
            raise ModelLoadError(f"{index_path}: shard {shard.name} named by the index is missing")
    return shards


def _listing(names: list[str]) -> str:
    if not names:
        return "none"
    more = len(names) - _LISTED_NAMES
    return ", ".join(names[:_LISTED_NAMES]) + (f" (+{more} more)" if more > 0 else "")
