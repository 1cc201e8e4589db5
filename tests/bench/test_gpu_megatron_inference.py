"""bench/megatron_inference.py's pieces that run without a GPU: the variants' names, the hook
around the engine's steps, and the per-step figures read from a profile."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron.core.inference.config import AsyncScheduleMode  # noqa: E402

from backends.megatron.serve import SERVING, Serving  # noqa: E402
from bench import megatron_inference  # noqa: E402


def test_each_variant_is_named_for_its_schedule_sampler_and_graphs() -> None:
    assert megatron_inference.variant("async+race") == SERVING
    legacy = megatron_inference.variant("legacy+megatron")
    assert legacy == Serving(schedule=AsyncScheduleMode.LEGACY, sampler="megatron")
    assert megatron_inference.name(SERVING, graphs=True) == "megatron_inference"
    assert megatron_inference.name(SERVING, graphs=False) == "megatron_inference_eager"
    assert megatron_inference.name(legacy, graphs=True) == "megatron_inference_legacy_megatron"


def test_the_hook_runs_around_each_step_and_leaves_the_engine_as_it_was() -> None:
    calls: list[str] = []

    def step() -> dict:
        calls.append("step")
        return {"finished_request_records": []}

    engine = SimpleNamespace(engine=SimpleNamespace(step_modern=step))
    with megatron_inference._around_steps(
        engine, lambda k: calls.append(f"before {k}"), lambda k: calls.append(f"after {k}")
    ):
        engine.engine.step_modern()
        engine.engine.step_modern()
    assert calls == ["before 0", "step", "after 0", "before 1", "step", "after 1"]
    assert engine.engine.step_modern is step


def _event(key: str, device: bool = False, self_device_us: float = 0.0, self_cpu_us: float = 0.0):
    return SimpleNamespace(
        key=key,
        device_type=torch.autograd.DeviceType.CUDA if device else torch.autograd.DeviceType.CPU,
        is_user_annotation=False,
        self_device_time_total=self_device_us,
        self_cpu_time_total=self_cpu_us,
    )


def test_a_profile_gives_the_gpus_busy_and_idle_time_and_the_hosts_wait_per_step() -> None:
    """The GPU's busy time is its own events' (a CPU op's device time is its kernels' again);
    the host's wait is its time in CUDA synchronisations."""
    events = [
        _event("aten::mm", self_device_us=3000.0, self_cpu_us=500.0),  # its kernel's time, again
        _event("nvjet_kernel", device=True, self_device_us=3000.0),
        _event("Memcpy DtoH", device=True, self_device_us=1000.0),
        _event("cudaStreamSynchronize", self_cpu_us=2000.0),
        _event("cudaEventSynchronize", self_cpu_us=2000.0),
        _event("cudaLaunchKernel", self_cpu_us=400.0),
    ]
    figures = megatron_inference.step_figures(events, steps=2, wall_s=0.010)
    assert figures == {
        "steps": 2,
        "wall_ms_per_step": 5.0,
        "device_busy_ms_per_step": 2.0,
        "device_idle_ms_per_step": 3.0,
        "host_sync_wait_ms_per_step": 2.0,
    }
