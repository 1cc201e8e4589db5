"""The megatron trainer: the recipe's RL algorithm on a megatron-core `GPTModel`.

`train_step(groups)` runs one pipeline step on the trainer's compute thread through the shared
update loop (`pipeline.algorithms.update.run_update`: minibatches, the algorithm's loss and
aggregation, the skip on a non-finite loss or gradient norm, the `train/*` metrics, as for
`TorchTrainer`); this backend supplies micro-batches (whole groups of at most
`micro_batch_samples` samples, or with `micro_batch_tokens` samples by length under that
budget of padded tokens), megatron's forward and its optimizer step.

Each sample is one right-padded sequence, prompt then response (megatron's model takes whole
sequences; the torch trainer computes a group's prompt once instead); only the response
positions go through the output layer (`response_logprobs`). Under tensor parallelism every
rank is given the same groups.

After each step and each load the weights an engine's `Decoder` should now hold
(`reshard.served`: gathered over tensor-parallel ranks, in the decoder's parameter names and
layout) are computed on every rank when anything reads them: with `fingerprints`
(`async_rl.handoff_checks`) their fingerprint, so the gate checks that the reshard into the
engine copied exactly these weights; and `on_weights`, given them (a Ray trainer rank keeps
them to publish, `served_parameters`; colocated under tensor parallelism rank 0 copies them
into its engine's decoder, since a wake on one rank cannot gather from the others). Under
tensor parallelism every rank gathers at these points whatever it does with the result: the
gathers are collectives.

`Checkpointable`: `save` writes the model and optimizer through megatron's `dist_checkpointing`
(directory `megatron/` of the step directory, resharded on load to any tensor-parallel size)
and the trainer's counters and RNG to `megatron-trainer.pt`; `load` reads both back.
`snapshot` copies the same to host memory for a background write (one rank; see there).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from backends.megatron import checkpoint, reshard
from backends.megatron.optimizer import Step
from backends.torch.compiles import compiled_graphs
from backends.torch.compute import ComputeThread
from backends.torch.config import ModelConfig
from backends.torch.fingerprint import Fingerprinter, parameter_probes
from backends.torch.host_copy import HostCopier
from backends.torch.logprobs import picked_logprobs
from backends.torch.schedule import lr_factor
from backends.torch.state_file import load_state, save_state
from pipeline.algorithms.config import Algorithm
from pipeline.algorithms.update import Chunk, DataParallel, run_update
from pipeline.contracts.backend_input import Batching, Optimizer
from pipeline.contracts.messages import TrainGroup, TrainSample
from pipeline.contracts.protocols import Snapshot

MODEL_DIR = "megatron"
STATE_FILE = "megatron-trainer.pt"


Row = tuple[tuple[int, ...], TrainSample]  # a sample with its prompt: one padded sequence


class _Inputs:
    """A micro-batch as megatron's model takes it: sequences [N, S] (prompt then response,
    right-padded) and, for each response token, the position that predicts it [N, R]."""

    def __init__(self, samples: list[Row], device: torch.device) -> None:
        width = max(len(p) + len(s.tokens) for p, s in samples)
        longest = max(len(s.tokens) for _, s in samples)
        self.ids = torch.tensor(
            [list(p) + list(s.tokens) + [0] * (width - len(p) - len(s.tokens)) for p, s in samples],
            device=device,
        )
        # Target j of the response is predicted at sequence position len(prompt) - 1 + j.
        starts = torch.tensor([len(p) - 1 for p, _ in samples], device=device)
        self.index = (starts[:, None] + torch.arange(longest, device=device)).clamp(max=width - 2)


def response_logprobs(
    model: Any, ids: torch.Tensor, index: torch.Tensor, mask: torch.Tensor, temperature: float
) -> torch.Tensor:
    """float32 [N, R]: log p(ids[n, index[n, r] + 1]) at temperature, times `mask`, from a
    `GPTModel` (or megatron's DDP of one) over the sequences `ids` [N, S] (the last token is only
    a target). Only the `index` positions' final-norm hidden states go through the output layer
    (`GPTModel`'s output hook): at one tensor-parallel rank by the torch trainer's
    `picked_logprobs` (no float32 logits), at several by megatron's vocabulary-parallel cross
    entropy, so ranks never gather the logits."""

    def hook(*, hidden_states: torch.Tensor, output_layer: Any, output_weight: Any, **_: Any) -> torch.Tensor:
        hidden = hidden_states.transpose(0, 1)  # [N, S-1, H] from megatron's [S-1, N, H]
        picked = hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))  # [N, R, H]
        targets = ids.gather(1, index + 1)
        if parallel_state.get_tensor_model_parallel_world_size() == 1:
            weight = output_weight if output_weight is not None else output_layer.weight
            return picked_logprobs(picked, weight, targets, temperature)
        rows = picked.transpose(0, 1).contiguous()  # [R, N, H]
        logits, _ = output_layer(rows, weight=output_weight, runtime_gather_output=False)
        return -vocab_parallel_cross_entropy(logits.float() / temperature, targets.T.contiguous()).T

    positions = torch.arange(ids.shape[1] - 1, device=ids.device).expand(ids.shape[0], -1)
    return model(ids[:, :-1], positions, attention_mask=None, output_processor=hook) * mask


def data_parallel() -> DataParallel | None:
    """This rank's place in megatron's data-parallel group (None: the only replica). Its
    tensor-parallel peers share its data-parallel rank, so they train the same groups."""
    size = parallel_state.get_data_parallel_world_size()
    if size == 1:
        return None
    group = parallel_state.get_data_parallel_group()
    return DataParallel(
        rank=parallel_state.get_data_parallel_rank(),
        size=size,
        all_sum=lambda t: dist.all_reduce(t, group=group),
    )


def by_groups(groups: list[TrainGroup], most: int) -> list[list[Row]]:
    """`groups` in order, whole, cut into micro-batches of at most `most` rows (a group over it
    alone makes a micro-batch of its own)."""
    parts: list[list[Row]] = [[]]
    for group in groups:
        if parts[-1] and len(parts[-1]) + len(group.samples) > most:
            parts.append([])
        parts[-1].extend((group.prompt_tokens, s) for s in group.samples)
    return parts


def by_length(samples: list[Row], budget: int, most: int) -> list[list[Row]]:
    """`samples` cut into micro-batches of at most `most` rows whose padded tokens (rows times
    the longest prompt plus response among them) fit `budget`: longest first (equal lengths in
    their order), each micro-batch taking the next ones while they fit; a sequence over the
    budget alone makes a micro-batch of its own."""
    parts: list[list[Row]] = []
    width = 0  # the current micro-batch's longest: its first
    for prompt, sample in sorted(samples, key=lambda row: -(len(row[0]) + len(row[1].tokens))):
        if not parts or len(parts[-1]) >= most or (len(parts[-1]) + 1) * width > budget:
            parts.append([])
            width = len(prompt) + len(sample.tokens)
        parts[-1].append((prompt, sample))
    return parts


class MegatronTrainer:
    def __init__(
        self,
        model: Any,  # a megatron GPTModel
        step: Step,
        *,
        config: ModelConfig,
        algorithm: Algorithm,
        optimizer: Optimizer,
        batching: Batching,
        temperature: float,
        seed: int,
        compute: ComputeThread | None = None,
        fingerprints: bool = False,
        on_weights: Callable[[list[tuple[str, torch.Tensor]]], None] | None = None,
    ) -> None:
        """`optimizer` (its learning rate and schedule: `step` applies the rest) and `batching`:
        the backend input's (`backends/input.py`)."""
        self.model = model  # the GPTModel (its parameters: what `reshard` reads)
        self.config = config
        self.fingerprints = fingerprints
        self.on_weights = on_weights
        self._published: dict[str, int] | None = None
        self._served: list[tuple[str, torch.Tensor]] | None = None
        self._previous: list[tuple[str, torch.Tensor]] | None = None
        self.optimizer = step
        self.algorithm = algorithm
        updates_per_step = batching.updates_per_step
        self.base_lr = optimizer.lr
        self.warmup_updates = optimizer.warmup_steps * updates_per_step
        self.total_updates = max(1, optimizer.total_steps * updates_per_step)
        self.schedule = optimizer.schedule
        self.min_lr_ratio = optimizer.min_lr_ratio
        self.micro_batch_samples = batching.micro_batch_samples
        self.micro_batch_tokens = batching.micro_batch_tokens
        self.updates_per_step = updates_per_step
        # Greedy generation reports temperature-1 logprobs, so recompute at 1 then as well.
        self.temperature = temperature if temperature > 0 else 1.0
        self.compute = compute or ComputeThread("trainer")
        self.device = next(model.parameters()).device
        self.generator = torch.Generator().manual_seed(seed)
        self.updates = 0
        self.skipped_steps = 0
        self._computed_tokens = 0  # this step's, by `micro_batches`
        self.completed_steps = 0
        self._reserved = False  # the snapshot buffer (`_host`) reserved

    async def train_step(self, groups: Sequence[TrainGroup]) -> dict[str, float]:
        return await self.compute.run(self._train_step, list(groups))

    def fingerprint(self) -> dict[str, int] | None:
        return self._published

    def served_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """The weights as an engine's `Decoder` holds them (names and layout), as of the last
        step or load (`keep_served`): gathered then, so no collective runs here."""
        assert self._served is not None, "keep_served() first"
        return self._served

    def keep_served(self) -> None:
        """Keep the served weights after each step and load, for `served_parameters`."""

        def keep(served: list[tuple[str, torch.Tensor]]) -> None:
            # The version before stays alive one step more: a replaced engine replica is
            # handed the last refit's CUDA IPC package, which may be that version's.
            self._previous, self._served = self._served, served

        self.on_weights = keep

    def weights_changed(self) -> None:
        """After a step or a load, and once built (module docstring); a collective under tensor
        parallelism: every rank calls it at the same points."""
        sharded = parallel_state.get_tensor_model_parallel_world_size() > 1
        if not (self.fingerprints or self.on_weights or sharded):
            return
        served = reshard.served(self.model, self.config)
        if self.fingerprints:
            self._published = Fingerprinter(parameter_probes(served))()
        if self.on_weights is not None:
            self.on_weights(served)

    def _lr(self, update: int) -> float:
        return self.base_lr * lr_factor(
            update,
            warmup_updates=self.warmup_updates,
            total_updates=self.total_updates,
            schedule=self.schedule,
            min_lr_ratio=self.min_lr_ratio,
        )

    has_reference = False

    def micro_batches(self, groups: list[TrainGroup]) -> list[Chunk]:
        """One minibatch's micro-batches, each sequence right-padded to its micro-batch's longest.
        Without `micro_batch_tokens`: whole groups in order, at most `micro_batch_samples`
        samples. With it: the minibatch's samples by length (`by_length`), so that a long-tailed
        minibatch pads its short samples to short neighbours, not to its longest (megatron's
        local attention takes no packed sequences)."""
        if self.micro_batch_tokens:
            rows = [(g.prompt_tokens, s) for g in groups for s in g.samples]
            parts = by_length(rows, self.micro_batch_tokens, self.micro_batch_samples)
        else:
            parts = by_groups(groups, self.micro_batch_samples)
        chunks = [Chunk.of([s for _, s in part], _Inputs(part, self.device), self.device) for part in parts]
        self._computed_tokens += sum(chunk.inputs.ids.numel() for chunk in chunks)
        return chunks

    def logprobs(self, chunk: Chunk, *, reference: bool = False) -> torch.Tensor:
        """Response logprobs [N, R] (0 past each response) of the model at its current weights."""
        assert not reference, "the megatron trainer has no reference model"
        inputs: _Inputs = chunk.inputs
        return response_logprobs(self.optimizer.model, inputs.ids, inputs.index, chunk.mask, self.temperature)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def lr(self) -> float:
        return self._lr(self.updates)

    def apply(self, *, finite_loss: bool) -> float | None:
        """Clip and step at this update's learning rate (megatron's `Step` skips a non-finite
        gradient norm itself); the gradient norm, or None when skipped (the schedule stays
        where it was)."""
        if finite_loss:
            grad_norm = self.optimizer.step(self._lr(self.updates))
        else:
            self.optimizer.zero_grad()
            grad_norm = math.nan
        if not math.isfinite(grad_norm):
            return None
        self.updates += 1  # the schedule counts applied updates, as megatron-LM's does
        return grad_norm

    def _train_step(self, groups: list[TrainGroup]) -> dict[str, float]:
        self.model.train()
        self._computed_tokens = 0
        compiled = compiled_graphs()
        parallel = data_parallel()
        metrics, skipped = run_update(
            self, groups, algorithm=self.algorithm, updates_per_step=self.updates_per_step, parallel=parallel
        )
        # What the micro-batches push through the layers (beside train/tokens, the responses'
        # own): each sequence whole, right-padded to the longest of its micro-batch; the whole
        # step's, every data-parallel rank's.
        computed = torch.tensor(float(self._computed_tokens), dtype=torch.float64, device=self.device)
        if parallel is not None:
            parallel.all_sum(computed)
        metrics["train/computed_tokens"] = float(computed)
        metrics["train/compiled_graphs"] = float(compiled_graphs() - compiled)  # this rank's
        self.skipped_steps += skipped
        metrics["train/skipped_steps"] = float(self.skipped_steps)
        self.completed_steps += 1
        self.weights_changed()
        if not self._reserved and dist.get_world_size() == 1:  # one rank snapshots (see there)
            self._reserved = True  # the state's size is known once the optimizer has its moments
            self._host.reserve(self._sharded_state(loading=False), leaf=checkpoint.sharded_leaf)
        return metrics

    def _sharded_state(self, *, loading: bool) -> dict[str, Any]:
        model_state = self.model.sharded_state_dict()
        optimizer_state = self.optimizer.sharded_state_dict(model_state, loading=loading)
        return {"model": model_state, "optimizer": optimizer_state}

    def save(self, directory: Path) -> None:
        checkpoint.save(self._sharded_state(loading=False), directory / MODEL_DIR)
        if dist.get_rank() == 0:  # the same on every rank
            save_state(directory / STATE_FILE, self._counters())

    def snapshot(self, directory: Path) -> Snapshot:
        """`save`'s state copied to host memory now (`pipeline.protocols.Snapshotting`), on the
        compute thread, written into `directory` by the snapshot's `write()` later, on another
        thread (its host buffer reserved after the first step, as the torch trainer's). Under
        tensor parallelism the files are written now instead: the write's collectives
        (dist_checkpointing's, the finiteness vote) would otherwise run beside the next step's
        on the same process group, in an order that may differ between ranks. megatron-core's
        own asynchronous save (`dist_checkpointing.save(..., async_sharded_save=True)`) does
        not lift that: its write runs in a worker process, but the checkpoint is complete only
        after `AsyncCallsQueue.maybe_finalize_async_calls`, which every rank must call at the
        same point (it all-reduces whether each rank's write is done, then each finalize
        function writes the metadata on rank 0 behind a barrier, on CUDA tensors), so the
        commit could come only at a later train step's call on the compute thread, not when
        this rank's write ends."""
        if dist.get_world_size() > 1:
            self.save(directory)
            return _Written()

        def take() -> _Snapshot:
            sharded = self._host.copy(self._sharded_state(loading=False), leaf=checkpoint.sharded_leaf)
            return _Snapshot(directory, sharded, self._counters())

        return self.compute.call(take)

    @functools.cached_property
    def _host(self) -> HostCopier:
        return HostCopier()

    def _counters(self) -> dict[str, Any]:
        return {
            "updates": self.updates,
            "generator": self.generator.get_state(),
            "skipped_steps": self.skipped_steps,
            "completed_steps": self.completed_steps,
        }

    def load(self, directory: Path) -> None:
        """Read both files whole and verified before any state changes."""
        loaded = checkpoint.load(self._sharded_state(loading=True), directory / MODEL_DIR)
        state = load_state(directory / STATE_FILE)
        self.model.load_state_dict(loaded["model"])
        self.optimizer.load_state_dict(loaded["optimizer"])
        self.updates = int(state["updates"])
        self.generator.set_state(state["generator"])
        self.skipped_steps = int(state["skipped_steps"])
        self.completed_steps = int(state["completed_steps"])
        self.weights_changed()

    def close(self) -> None:
        """Stop the compute thread (after its current call)."""
        self.compute.close()


class _Snapshot:
    """A one-rank trainer's sharded state and counters in host memory, written by `write()`."""

    def __init__(self, directory: Path, sharded: dict[str, Any], counters: dict[str, Any]) -> None:
        self.directory = directory
        self.sharded = sharded
        self.counters = counters

    def write(self) -> None:
        checkpoint.save(self.sharded, self.directory / MODEL_DIR)
        save_state(self.directory / STATE_FILE, self.counters)


class _Written:
    """A snapshot whose files were written when it was taken."""

    written = True

    def write(self) -> None:
        pass
