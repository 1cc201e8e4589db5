"""The torch GRPO trainer: AdamW, warmup + cosine/constant schedule, clipping, micro-batching.

`train_step(samples, advantages)` runs one pipeline step in a worker thread: it optionally
recomputes the pre-step logprobs (only needed when a step makes several optimizer updates;
with one update they equal the detached logprobs of the same forward), splits the samples into
`updates_per_step` minibatches, accumulates gradients over micro-batches of at most
`micro_batch_samples`, and steps the optimizer once per minibatch. A non-finite loss or gradient
norm skips that update (counted in `train/skipped_steps`), so no NaN reaches the weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import anyio
import torch

from backends.torch.grpo_loss import LossConfig, grpo_token_loss, mismatch_metrics
from backends.torch.model import Decoder, token_logprobs
from pipeline.messages import Sample


class TorchTrainer:
    def __init__(
        self,
        model: Decoder,
        *,
        loss: LossConfig,
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
        warmup_steps: int,
        schedule: str,
        min_lr_ratio: float,
        total_steps: int,
        grad_clip: float,
        micro_batch_samples: int,
        updates_per_step: int,
        temperature: float,
        seed: int,
        reference: Decoder | None = None,
    ) -> None:
        self.model = model
        self.loss = loss
        self.grad_clip = grad_clip
        self.micro_batch_samples = micro_batch_samples
        self.updates_per_step = updates_per_step
        # Greedy generation reports temperature-1 logprobs, so recompute at 1 then as well.
        self.temperature = temperature if temperature > 0 else 1.0
        self.reference = reference
        self.device = next(model.parameters()).device
        fused = self.device.type == "cuda"
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay, fused=fused
        )
        total_updates = max(1, total_steps * updates_per_step)
        warmup_updates = warmup_steps * updates_per_step

        def factor(update: int) -> float:
            if update < warmup_updates:
                return (update + 1) / warmup_updates
            if schedule == "constant":
                return 1.0
            progress = min(1.0, (update - warmup_updates) / max(1, total_updates - warmup_updates))
            return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
        self.generator = torch.Generator().manual_seed(seed)
        self.skipped_steps = 0
        self.completed_steps = 0

    async def train_step(self, samples: Sequence[Sample], advantages: Sequence[float]) -> dict[str, float]:
        return await anyio.to_thread.run_sync(self._train_step, list(samples), list(advantages))

    def _tensors(self, samples: Sequence[Sample], advantages: Sequence[float]) -> dict[str, torch.Tensor]:
        """Right-padded sequences with response masks aligned to `token_logprobs` output."""
        # Rows are built as Python lists and converted once: one tensor per row would cost a
        # few hundred small allocations per step on the CPU quickstart's hot path.
        width = max(len(s.prompt_tokens) + len(s.tokens) for s in samples)
        ids, attention, mask, gen = [], [], [], []
        for sample in samples:
            p, r = len(sample.prompt_tokens), len(sample.tokens)
            ids.append([*sample.prompt_tokens, *sample.tokens] + [0] * (width - p - r))
            attention.append([True] * (p + r) + [False] * (width - p - r))
            mask.append([0.0] * (p - 1) + [1.0] * r + [0.0] * (width - p - r))
            gen.append([0.0] * (p - 1) + list(sample.logprobs) + [0.0] * (width - p - r))
        return {
            "ids": torch.tensor(ids, dtype=torch.long, device=self.device),
            "attention": torch.tensor(attention, dtype=torch.bool, device=self.device),
            "mask": torch.tensor(mask, device=self.device),
            "gen": torch.tensor(gen, device=self.device),
            "advantages": torch.tensor(advantages, dtype=torch.float32, device=self.device),
        }

    def _logprobs(self, model: Decoder, batch: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        return token_logprobs(model, batch["ids"][rows], batch["attention"][rows], self.temperature)

    @torch.no_grad()
    def _recompute(self, model: Decoder, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        n = batch["ids"].shape[0]
        chunks = [
            self._logprobs(model, batch, torch.arange(i, min(n, i + self.micro_batch_samples)))
            for i in range(0, n, self.micro_batch_samples)
        ]
        return torch.cat(chunks)

    def _train_step(self, samples: list[Sample], advantages: list[float]) -> dict[str, float]:
        self.model.train()
        batch = self._tensors(samples, advantages)
        n = len(samples)
        old = self._recompute(self.model, batch) if self.updates_per_step > 1 else None
        reference = self._recompute(self.reference, batch) if self.reference is not None else None
        order = torch.randperm(n, generator=self.generator).to(self.device)
        minibatches = [m for m in order.tensor_split(self.updates_per_step) if m.numel()]
        totals: dict[str, float] = {"loss": 0.0, "clip_fraction": 0.0, "kl_ref": 0.0, "tokens": 0.0}
        train_lp: list[torch.Tensor] = []
        grad_norms: list[float] = []
        for minibatch in minibatches:
            tokens = batch["mask"][minibatch].sum().clamp(min=1.0)
            self.optimizer.zero_grad(set_to_none=True)
            loss_sum = torch.zeros((), device=self.device)
            for micro in minibatch.split(self.micro_batch_samples):
                lp = self._logprobs(self.model, batch, micro)
                before = lp.detach() if old is None else old[micro]
                if old is None:
                    train_lp.append(before)
                parts = grpo_token_loss(
                    lp,
                    old=before,
                    gen=batch["gen"][micro],
                    reference=None if reference is None else reference[micro],
                    advantages=batch["advantages"][micro],
                    mask=batch["mask"][micro],
                    config=self.loss,
                )
                (parts["loss_sum"] / tokens).backward()
                loss_sum += parts["loss_sum"].detach()
                totals["clip_fraction"] += float(parts["clipped"])
                totals["kl_ref"] += float(parts["kl_sum"])
            totals["loss"] += float(loss_sum)
            totals["tokens"] += float(tokens)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip))
            if math.isfinite(grad_norm) and math.isfinite(float(loss_sum)):
                self.optimizer.step()
                grad_norms.append(grad_norm)
            else:
                self.skipped_steps += 1
                self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
        if old is None:  # one update: the logprobs of its forward are the pre-step ones
            trained_lp = torch.empty_like(batch["gen"])
            trained_lp[torch.cat(minibatches)] = torch.cat(train_lp)
        else:
            trained_lp = old
        metrics = mismatch_metrics(trained_lp, batch["gen"], batch["mask"])
        tokens = max(1.0, totals["tokens"])
        metrics.update(
            {
                "train/loss": totals["loss"] / tokens,
                "train/grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else math.nan,
                "train/clip_fraction": totals["clip_fraction"] / tokens,
                "train/lr": self.scheduler.get_last_lr()[0],
                "train/skipped_steps": float(self.skipped_steps),
                "train/tokens": tokens,
            }
        )
        if reference is not None:
            metrics["train/kl_ref"] = totals["kl_ref"] / tokens
        self.completed_steps += 1
        return metrics

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "generator": self.generator.get_state(),
            "skipped_steps": self.skipped_steps,
            "completed_steps": self.completed_steps,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["generator"])
        self.skipped_steps = int(state["skipped_steps"])
        self.completed_steps = int(state["completed_steps"])
