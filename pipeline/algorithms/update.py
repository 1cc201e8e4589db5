"""The one update loop: a pipeline step's groups in, optimizer updates applied, `train/*` out.

Every trainer backend calls `run_update` with itself as the `UpdateBackend` (its forward, its
micro-batch packing, its optimizer step), so the algorithm (advantages are already in the
samples; the loss, its aggregation, clipping and IS correction here) is written once.

A step: the groups are shuffled with the backend's generator and split whole into
`updates_per_step` minibatches, one optimizer update each; the backend packs each minibatch into
micro-batches whose gradients add up. With several updates a step the pre-step logprobs are
computed first (later updates compare against the pre-step policy); with one they equal the
detached logprobs of the same forward. The aggregation's weights come from the whole
minibatch's counts, so the micro-batch split does not change the update. A non-finite loss or
gradient norm skips that update (the backend drops its gradients), so no NaN reaches the weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pipeline.algorithms.aggregation import AGGREGATIONS, Counts
from pipeline.algorithms.config import Algorithm
from pipeline.algorithms.losses import LOSSES, LossInputs, mismatch_metrics
from pipeline.contracts.messages import TrainGroup, TrainSample


@dataclass
class Chunk:
    """A micro-batch: its samples' behaviour logprobs, advantages and mask [N, R] / [N], the
    backend's own packed `inputs`, and, once computed, the pre-step and reference logprobs."""

    inputs: Any
    gen: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    old: torch.Tensor | None = None
    reference: torch.Tensor | None = None

    @classmethod
    def of(cls, samples: Sequence[TrainSample], inputs: Any, device: torch.device) -> Chunk:
        longest = max(len(s.tokens) for s in samples)
        # The loss mask: 1 on each sample's own tokens that the model generated, 0 on padding
        # and on an environment's tokens (multi-turn), which are context and never trained.
        mask = [list(s.loss_mask or (1,) * len(s.tokens)) for s in samples]
        return cls(
            inputs=inputs,
            gen=torch.tensor(
                [list(s.logprobs) + [0.0] * (longest - len(s.logprobs)) for s in samples], device=device
            ),
            advantages=torch.tensor([s.advantage for s in samples], device=device),
            mask=torch.tensor([row + [0] * (longest - len(row)) for row in mask], device=device).to(
                torch.get_default_dtype()
            ),
        )


class UpdateBackend(Protocol):
    """What a trainer gives the loop."""

    device: torch.device
    generator: torch.Generator

    @property
    def has_reference(self) -> bool: ...

    def micro_batches(self, groups: list[TrainGroup]) -> list[Chunk]: ...

    def logprobs(self, chunk: Chunk, *, reference: bool = False) -> torch.Tensor:
        """Response logprobs [N, R] of the policy (with gradient) or the reference model."""
        ...

    def zero_grad(self) -> None: ...

    def apply(self, *, finite_loss: bool) -> float | None:
        """Clip and apply the accumulated gradients, and advance the learning-rate schedule;
        the gradient norm, or None when the update was skipped (a non-finite loss or norm:
        the gradients dropped, the weights and the schedule untouched: the schedule counts
        applied updates, as megatron-LM's `train_step` steps its scheduler only after a
        successful update)."""
        ...

    def lr(self) -> float: ...


def run_update(
    backend: UpdateBackend, groups: Sequence[TrainGroup], *, algorithm: Algorithm, updates_per_step: int
) -> tuple[dict[str, float], int]:
    """One step's updates on `groups`; (the step's `train/*` metrics, updates skipped)."""
    loss_fn, aggregation = LOSSES.get(algorithm.policy_loss), AGGREGATIONS.get(algorithm.loss_aggregation)
    groups = list(groups)
    order = torch.randperm(len(groups), generator=backend.generator).tolist()
    minibatches = [
        backend.micro_batches([groups[g] for g in part.tolist()])
        for part in torch.tensor(order).tensor_split(min(updates_per_step, len(groups)))
    ]
    chunks = [c for minibatch in minibatches for c in minibatch]
    with torch.no_grad():
        if updates_per_step > 1:
            for chunk in chunks:
                chunk.old = backend.logprobs(chunk)
        if backend.has_reference:
            for chunk in chunks:
                chunk.reference = backend.logprobs(chunk, reference=True)
    loss_total = clipped = kl_total = tokens_total = 0.0
    grad_norms: list[float] = []
    skipped = 0
    for minibatch in minibatches:
        counts = Counts(
            tokens=float(sum(c.mask.sum() for c in minibatch)),
            sequences=float(sum(c.mask.shape[0] for c in minibatch)),
            max_new_tokens=algorithm.max_new_tokens,
        )
        backend.zero_grad()
        loss = torch.zeros((), device=backend.device)
        for chunk in minibatch:
            lp = backend.logprobs(chunk)
            if chunk.old is None:  # one update: this forward's logprobs are the pre-step ones
                chunk.old = lp.detach()
            out = loss_fn(
                LossInputs(
                    logprobs=lp,
                    old=chunk.old,
                    gen=chunk.gen,
                    reference=chunk.reference,
                    advantages=chunk.advantages,
                    mask=chunk.mask,
                ),
                algorithm.loss,
            )
            part = (out.per_token * aggregation(chunk.mask, counts)).sum()
            part.backward()
            loss += part.detach()
            clipped += float((out.clipped * chunk.mask).sum())
            kl_total += float((out.kl * chunk.mask).sum())
        loss_value = float(loss)
        grad_norm = backend.apply(finite_loss=math.isfinite(loss_value))
        if grad_norm is None:
            skipped += 1
        else:
            grad_norms.append(grad_norm)
        loss_total += loss_value * counts.tokens
        tokens_total += counts.tokens
    masks = [c.mask.bool() for c in chunks]
    metrics = mismatch_metrics(
        torch.cat([c.old[m] for c, m in zip(chunks, masks, strict=True) if c.old is not None]),
        torch.cat([c.gen[m] for c, m in zip(chunks, masks, strict=True)]),
        torch.ones(int(sum(m.sum() for m in masks)), device=backend.device),
    )
    tokens = max(1.0, tokens_total)
    metrics.update(
        {
            "train/loss": loss_total / tokens,
            "train/grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else math.nan,
            "train/clip_fraction": clipped / tokens,
            "train/lr": backend.lr(),
            "train/applied_updates": float(len(grad_norms)),
            "train/tokens": tokens,
        }
    )
    if backend.has_reference:
        metrics["train/kl_ref"] = kl_total / tokens
    return metrics, skipped
