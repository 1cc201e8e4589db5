"""The one update loop: a pipeline step's groups in, optimizer updates applied, `train/*` out.

Every trainer backend calls `run_update` with itself as the `UpdateBackend` (its forward, its
micro-batch packing, its optimizer step), so the algorithm (advantages are already in the
samples; the loss, its aggregation, clipping and IS correction here) is written once.

A step: the groups are shuffled with the backend's generator and split whole into
`updates_per_step` minibatches, one optimizer update each; the backend packs each minibatch into
micro-batches whose gradients add up. Every update compares against the pre-step policy: the
first minibatch's pre-step logprobs are the detached logprobs of its own forward (no update has
run yet), and those of each later minibatch are computed before the first update, in one
forward without gradients (a step of N updates costs N-1 minibatches' such forwards, not N).
The aggregation's weights come from the whole minibatch's counts, so the micro-batch split does
not change the update. A non-finite loss or gradient norm skips that update (the backend drops
its gradients), so no NaN reaches the weights.

Data parallel (`DataParallel`): every rank is given the step's same groups and shuffles them
alike; of each minibatch it trains its own share (`shares`: whole groups, balanced by tokens),
with the aggregation's weights from the whole minibatch's counts, so the ranks' gradients summed
(the backend's `apply` sums them) are one rank's gradient on every group. The minibatch's loss
is summed over the ranks before the skip decision (every rank skips alike), and the `train/*`
metrics are those of the whole step, the same on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
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


@dataclass(frozen=True)
class DataParallel:
    """This trainer's rank among `size` data-parallel ranks; `all_sum(t)` sums the tensor `t`
    over the ranks in place (a collective: every rank calls it at the same point)."""

    rank: int
    size: int
    all_sum: Callable[[torch.Tensor], None]


def trained_tokens(sample: TrainSample) -> int:
    """The sample's tokens in the loss (its loss mask's: an environment's tokens are not)."""
    return sum(sample.loss_mask) if sample.loss_mask else len(sample.tokens)


def group_tokens(group: TrainGroup) -> int:
    """The tokens a group costs a forward: its prompt once and every response."""
    return len(group.prompt_tokens) + sum(len(s.tokens) for s in group.samples)


def shares(groups: Sequence[TrainGroup], size: int) -> list[list[int]]:
    """The indices of `groups` each of `size` ranks trains: whole groups, balanced by tokens
    (the largest group first, to the rank with the fewest tokens so far; ties to the lowest
    rank), each rank's in the given order. The same on every rank for the same groups."""
    load = [0] * size
    owned: list[list[int]] = [[] for _ in range(size)]
    by_size = sorted(range(len(groups)), key=lambda i: -group_tokens(groups[i]))  # stable
    for index in by_size:
        rank = min(range(size), key=lambda r: (load[r], r))
        owned[rank].append(index)
        load[rank] += group_tokens(groups[index])
    return [sorted(indices) for indices in owned]


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
    backend: UpdateBackend,
    groups: Sequence[TrainGroup],
    *,
    algorithm: Algorithm,
    updates_per_step: int,
    parallel: DataParallel | None = None,
) -> tuple[dict[str, float], int]:
    """One step's updates on `groups` (with `parallel`, this rank's share of them: module
    docstring); (the step's `train/*` metrics, updates skipped)."""
    loss_fn, aggregation = LOSSES.get(algorithm.policy_loss), AGGREGATIONS.get(algorithm.loss_aggregation)
    groups = list(groups)
    order = torch.randperm(len(groups), generator=backend.generator).tolist()
    parts = [
        [groups[g] for g in part.tolist()]
        for part in torch.tensor(order).tensor_split(min(updates_per_step, len(groups)))
    ]
    # Each minibatch's counts are the whole minibatch's, whichever rank trains which group.
    all_counts = [
        Counts(
            tokens=float(sum(trained_tokens(s) for g in part for s in g.samples)),
            sequences=float(sum(len(g.samples) for g in part)),
            max_response_tokens=algorithm.max_response_tokens,
        )
        for part in parts
    ]
    if parallel is not None:
        parts = [[part[i] for i in shares(part, parallel.size)[parallel.rank]] for part in parts]
    minibatches = [backend.micro_batches(part) if part else [] for part in parts]
    chunks = [c for minibatch in minibatches for c in minibatch]
    with torch.no_grad():
        # The first minibatch's own forward runs before any update: its logprobs are pre-step.
        for chunk in (c for minibatch in minibatches[1:] for c in minibatch):
            chunk.old = backend.logprobs(chunk)
        if backend.has_reference:
            for chunk in chunks:
                chunk.reference = backend.logprobs(chunk, reference=True)
    loss_total = clipped = kl_total = tokens_total = 0.0
    grad_norms: list[float] = []
    skipped = 0
    for minibatch, counts in zip(minibatches, all_counts, strict=True):
        backend.zero_grad()
        loss = torch.zeros((), device=backend.device)
        for chunk in minibatch:
            lp = backend.logprobs(chunk)
            if chunk.old is None:  # the first minibatch: this forward's logprobs are the pre-step ones
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
        if parallel is not None:
            parallel.all_sum(loss)
        loss_value = float(loss)
        grad_norm = backend.apply(finite_loss=math.isfinite(loss_value))
        if grad_norm is None:
            skipped += 1
        else:
            grad_norms.append(grad_norm)
        loss_total += loss_value * counts.tokens
        tokens_total += counts.tokens
    masks = [c.mask.bool() for c in chunks]
    if parallel is None:
        metrics = mismatch_metrics(
            torch.cat([c.old[m] for c, m in zip(chunks, masks, strict=True) if c.old is not None]),
            torch.cat([c.gen[m] for c, m in zip(chunks, masks, strict=True)]),
            torch.ones(int(sum(m.sum() for m in masks)), device=backend.device),
        )
    else:
        metrics, clipped, kl_total = _whole_step(chunks, masks, clipped, kl_total, parallel, backend.device)
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


def _whole_step(
    chunks: list[Chunk],
    masks: list[torch.Tensor],
    clipped: float,
    kl_total: float,
    parallel: DataParallel,
    device: torch.device,
) -> tuple[dict[str, float], float, float]:
    """The mismatch metrics over every rank's tokens, and the clipped and KL totals summed over
    the ranks (a rank may have trained no group of a small step)."""
    sums = torch.zeros(5, dtype=torch.float64, device=device)
    for chunk, mask in zip(chunks, masks, strict=True):
        assert chunk.old is not None  # every trained chunk's pre-step logprobs
        r = chunk.old[mask] - chunk.gen[mask]
        sums[0] += torch.exp(r.abs()).sum().double()
        sums[1] += (torch.exp(r) - 1.0 - r).sum().double()
        sums[2] += mask.sum().double()
    sums[3], sums[4] = clipped, kl_total
    parallel.all_sum(sums)
    tokens = max(float(sums[2]), 1.0)
    metrics = {
        "train/token_mult_prob_error": float(sums[0]) / tokens,
        "train/gen_kl_error": float(sums[1]) / tokens,
    }
    return metrics, float(sums[3]), float(sums[4])
