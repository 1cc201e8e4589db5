"""The tensor-parallel test's model and trainer, built the same at every size."""

from __future__ import annotations

import torch

from backends.megatron import layout
from backends.megatron.model import build_gpt_model
from backends.megatron.optimizer import TorchAdamW
from backends.megatron.trainer import MegatronTrainer
from pipeline.algorithms.config import Algorithm, LossConfig
from tests.backends.megatron_cases import CONFIGS
from tests.backends.trainer_inputs import batching, optimizer

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
        optimizer=optimizer(grad_clip=0.5),
        batching=batching(micro_batch_samples=6),
        temperature=1.0,
        seed=3,
    )
