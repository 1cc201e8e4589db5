"""`rollout.attention`: which kernels megatron's engine attends with, on the CPU. The adapter's
functions reach a `flash_attn` that flash-attn-4 installed alone (a namespace of its
`flash_attn.cute`, without flash-attn 2's functions), and every attention layer of the served
model is pinned to the generation asked for, so an installed flash-attn-4 never takes over the
adapter's path unasked (tests/gpu runs the kernels)."""

from __future__ import annotations

import sys
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from backends.megatron import flash_adapter, parallel, serve  # noqa: E402
from backends.megatron.model import build_gpt_model  # noqa: E402
from tests.backends.megatron_cases import CONFIGS  # noqa: E402

CPU = torch.device("cpu")


def test_flash_attn_4_alone_gets_the_adapters_functions(monkeypatch) -> None:
    namespace = types.ModuleType("flash_attn")  # what `import flash_attn` gives with flash-attn-4 alone
    monkeypatch.setitem(sys.modules, "flash_attn", namespace)
    flash_adapter.install()
    assert namespace.flash_attn_varlen_func is flash_adapter.flash_attn_varlen_func
    assert namespace.flash_attn_with_kvcache is flash_adapter.flash_attn_with_kvcache


def test_a_real_flash_attn_2_is_left_alone(monkeypatch) -> None:
    real = types.ModuleType("flash_attn")
    real.flash_attn_varlen_func = object()  # type: ignore[attr-defined]
    real.flash_attn_with_kvcache = object()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", real)
    flash_adapter.install()
    assert real.flash_attn_varlen_func is not flash_adapter.flash_attn_varlen_func


@pytest.mark.parametrize(("attention", "generation"), [("adapter", 2), ("flash-attn-4", 4)])
def test_the_engine_pins_every_attention_layer_to_the_generation_asked_for(
    monkeypatch, attention: str, generation: int
) -> None:
    """`dynamic_engine` (megatron's CUDA-only classes replaced by stand-ins) pins the served
    model's attention layers before it builds the engine."""
    parallel.initialise(device=CPU)
    model = build_gpt_model(CONFIGS["qwen2-bias"], dtype=torch.float32, device=CPU)
    layers = [m for m in model.modules() if hasattr(m, "_resolve_flash_version")]
    assert len(layers) == CONFIGS["qwen2-bias"].num_hidden_layers

    class Controller:
        def __init__(self, wrapped, tokens) -> None:
            self.sampling_rng = torch.Generator()

    monkeypatch.setattr(serve, "DynamicInferenceContext", lambda config, inference: None)
    monkeypatch.setattr(serve, "GPTInferenceWrapper", lambda model, context: None)
    monkeypatch.setattr(serve, "TextGenerationController", Controller)
    monkeypatch.setattr(serve, "DynamicInferenceEngine", lambda controller, context: controller)
    monkeypatch.setattr(serve.torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(flash_adapter, "single_split", lambda device: True)  # as on an H200
    serve.dynamic_engine(
        model, None, tokens=serve._Tokens(1, 32), seed=0, device=CPU, sampler="megatron", attention=attention
    )
    assert [layer.flash_attention_version for layer in layers] == [generation] * len(layers)
    # flash-attn-4 on SM 9.0: megatron passes num_splits 1 where the layer's flag is set
    assert [layer.batch_invariant_mode for layer in layers] == [generation == 4] * len(layers)
    if attention == "adapter":  # megatron's flash-attn 2 calls: the adapter's functions
        assert layers[0]._resolve_flash_version() == (False, False)


@pytest.mark.parametrize(
    ("device", "capability", "one"),
    [
        ("cpu", None, False),
        ("cuda", (9, 0), True),
        ("cuda", (10, 0), False),
        ("cuda", (8, 0), False),
    ],
)
def test_flash_attn_4_attends_with_one_split_on_hopper_only(monkeypatch, device, capability, one) -> None:
    """flash-attn-4's SM 9.0 forward refuses a split of the keys, so there (and only there) the
    layers ask megatron for one split."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    assert flash_adapter.single_split(torch.device(device)) is one


@pytest.mark.parametrize(
    ("body", "refused"),
    [
        ("def flash_attn_varlen_func(*args, **kwargs): ...\n", None),
        ("import cutlass  # not on the path\n", "No module named 'cutlass'"),
        ("raise OSError('libcuda.so.1: cannot open shared object file')\n", "libcuda.so.1"),
    ],
    ids=["imports", "a-module-missing", "a-library-missing"],
)
def test_flash_attn_4_that_does_not_import_is_refused_with_its_import_error(
    monkeypatch, tmp_path, body: str, refused: str | None
) -> None:
    """An installed flash-attn-4 whose kernels' module fails to import (its cutlass off the path,
    a shared library it cannot load) is what megatron takes for "not installed": `validate` says
    so, with why. The package here is real files on the path, as pip lays it out."""
    from backends.megatron import rules

    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)  # flash_attn: a namespace package
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("flash_attn", "flash_attn.cute", "cutlass"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(rules, "version", lambda name: "4.0.0b36")
    missing = rules.flash_attn_4_missing()
    if refused is None:
        assert missing is None
    else:
        assert missing is not None and missing.startswith("4.0.0b36 is installed but does not import: ")
        assert refused in missing, missing
