"""`build_backend` wires the megatron trainer to our torch engine: the engine serves megatron's
weights after each wake (colocated) or refit (separate), and refuses what it cannot do."""

from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import pipeline  # noqa: E402
from backends.megatron import layout  # noqa: E402
from backends.megatron.build import build_backend  # noqa: E402
from pipeline.contracts.errors import RecipeError  # noqa: E402
from pipeline.shell.backend_input import backend_input  # noqa: E402
from tests.backends.megatron_cases import groups  # noqa: E402


def _recipe(*overrides: str):
    return backend_input(pipeline.load_recipe("recipes/quickstart.yaml", ["run.progress=false", *overrides]))


def _served(engine) -> dict:
    return engine.sampler.model.state_dict()


def _trained(trainer, engine) -> dict:
    return layout.to_hf([layout.parameters(trainer.model)], engine.sampler.model.config)


@pytest.mark.parametrize("colocated", [True, False])
async def test_the_engine_serves_the_trained_weights_after_its_hand_off(colocated: bool) -> None:
    engine, trainer = build_backend(
        _recipe(f"colocated={str(colocated).lower()}"), vocab_size=16, stop_ids=[1]
    )
    try:
        assert engine.blocks_training is colocated and engine.wake_carries_weights is colocated
        start = {k: v.clone() for k, v in _served(engine).items()}
        if colocated:
            await engine.stand_down()
        await trainer.train_step(groups(vocab=16))
        assert all(torch.equal(start[k], v) for k, v in _served(engine).items())  # not yet handed off
        published = trainer.fingerprint()
        assert published is not None and published != engine.fingerprint()
        await (engine.wake() if colocated else engine.refit())
        assert engine.fingerprint() == published  # what the gate's handoff check compares
        trained = _trained(trainer, engine)
        assert not all(torch.equal(start[k], trained[k]) for k in start)
        for key, value in _served(engine).items():
            assert torch.equal(value, trained[key]), key
        completions = await engine.generate([3, 4, 5], 2)
        assert len(completions) == 2
    finally:
        engine.close()
        trainer.close()


def test_train_compile_compiles_each_megatron_layer_and_the_engine_rounds_alike() -> None:
    """Wiring only: the compiled step itself is measured on the GPU (bench.gpu's megatron mode)."""
    for compiled in (False, True):
        engine, trainer = build_backend(
            _recipe(f"train.compile={str(compiled).lower()}"), vocab_size=16, stop_ids=[1]
        )
        try:
            layers = list(trainer.model.decoder.layers)
            assert [layer._compiled_call_impl is not None for layer in layers] == [compiled] * len(layers)
            assert engine.sampler.eager_rounding is not compiled
        finally:
            engine.close()
            trainer.close()


def test_train_options_it_lacks_are_refused_by_name() -> None:
    with pytest.raises(RecipeError) as error:
        build_backend(_recipe("train.kl_coef=0.1"), vocab_size=16, stop_ids=[1])
    assert str(error.value) == (
        "train.kl_coef: 0.1 needs a reference model, which train.backend megatron does not have "
        "yet; use train.backend: torch, or leave train.kl_coef at 0.0"
    )


def test_without_megatron_core_the_backend_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "megatron.core", None)  # `import megatron.core` now fails
    with pytest.raises(RecipeError) as error:
        build_backend(_recipe(), vocab_size=16, stop_ids=[1])
    assert str(error.value) == (
        "train.backend: megatron needs megatron-core, which does not import here (import of "
        "megatron.core halted; None in sys.modules); install it with: pip install --no-deps "
        "--ignore-requires-python megatron-core==0.19.2 triton==3.6.0 && pip install psutil tqdm (see README)"
    )


@pytest.mark.parametrize("missing", ["psutil", "tqdm"])
def test_what_megatron_core_needs_undeclared_is_checked_before_the_run(
    monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    """Without psutil a run trained, then failed at its first save with worker tracebacks, and
    `validate` had said ok: the pre-flight checks (`registry.check`) refuse it now."""
    from backends import registry

    monkeypatch.setitem(sys.modules, missing, None)  # find_spec now finds nothing
    with pytest.raises(RecipeError) as error:
        registry.check(_recipe("train.backend=megatron"))
    assert str(error.value) == (
        f"train.backend: megatron needs {missing}, which megatron-core uses without declaring it; "
        f"install with: pip install {missing} (or this project's extra: pip install -e '.[megatron]')"
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["train.backend=torch", "train.tensor_parallel=2"],
            "train.tensor_parallel: 2 needs train.backend: megatron (the torch trainer holds the "
            "whole model on one device)",
        ),
        (
            ["train.backend=megatron", "train.tensor_parallel=2"],
            "train.tensor_parallel: 2 needs placement.backend: ray (a pipeline process is one rank: "
            "Ray starts one trainer actor a rank)",
        ),
        (
            [
                "train.backend=megatron",
                "placement.backend=ray",
                "colocated=false",
                "placement.weights=collective",
            ],
            "placement.weights: collective is not built for train.backend megatron (its broadcast "
            "group would replace the process group megatron's trainer holds); set "
            "placement.weights: auto",
        ),
    ],
)
def test_tensor_parallel_and_collective_weights_are_refused_where_not_built(
    overrides: list[str], message: str
) -> None:
    """What `validate` and `run` refuse before building (the backend's `check`)."""
    from backends import registry

    with pytest.raises(RecipeError) as error:
        registry.check(_recipe(*overrides))
    assert str(error.value) == message


def test_a_tensor_parallel_size_that_does_not_divide_the_model_is_refused_by_name() -> None:
    from backends.megatron.build import check_shape
    from tests.backends.megatron_cases import CONFIGS

    config = CONFIGS["qwen2-bias"]
    check_shape(config, 2)
    with pytest.raises(RecipeError) as error:
        check_shape(config, 3)
    assert str(error.value).startswith(
        "train.tensor_parallel: 3 does not divide the model's num_attention_heads"
    )


def test_tensor_parallel_on_cuda_needs_a_gpu_for_each_trainer_rank() -> None:
    with pytest.raises(RecipeError, match="each trainer rank needs a GPU of its own"):
        _recipe(
            "train.backend=megatron",
            "train.tensor_parallel=2",
            "placement.backend=ray",
            "model.device=cuda",
            "placement.trainer_gpus=0.5",
        )
