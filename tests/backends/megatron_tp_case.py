"""The tensor-parallel test's model and trainer, built the same at every size."""

from __future__ import annotations

import torch

from backends.megatron import layout
from backends.megatron.model import build_gpt_model
from backends.megatron.optimizer import TorchAdamW
from backends.megatron.trainer import MegatronTrainer
from pipeline.algorithms.config import Algorithm, LossConfig
from tests.backends.megatron_cases import CONFIGS

CONFIG = CONFIGS["qwen2-bias"]  # GQA, biases: every sharded layout


def trainer(hf: dict, *, rank: int, size: int) -> MegatronTrainer:
    model = build_gpt_model(CONFIG, dtype=torch.float32, device=torch.device("cpu"), tensor_parallel=size)
    layout.load_hf(model, hf, CONFIG, rank=rank, size=size)
    return MegatronTrainer(
        model,
        TorchAdamW(model, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, grad_clip=0.5),
        config=CONFIG,
        algorithm=Algorithm(
            loss=LossConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.0, is_correction="tis", is_cap=2.0)
        ),
        lr=1e-3,
        warmup_steps=0,
        schedule="constant",
        min_lr_ratio=0.1,
        total_steps=10,
        micro_batch_samples=6,
        updates_per_step=1,
        temperature=1.0,
        seed=3,
    )
