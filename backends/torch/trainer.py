"""The torch trainer: AdamW with float32 masters, warmup + cosine/constant schedule, clipping,
micro-batching, optimizer offload, data parallelism (`backends/torch/data_parallel.py`).

`train_step(groups)` runs one pipeline step on the trainer's compute thread through the shared
update loop (`pipeline.algorithms.update.run_update`: minibatches, the recipe's algorithm, the
skip on a non-finite loss or gradient norm, the `train/*` metrics); this backend supplies the
forward (each group's prompt computed once per micro-batch, its responses packed without
padding), the micro-batch packing (by samples, and by computed tokens with `micro_batch_tokens`)
and the optimizer step.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from backends.torch.compiles import compiled_graphs
from backends.torch.compute import ComputeThread
from backends.torch.data_parallel import RankGroup, grad_norm, owners, share_owned, sum_gradients
from backends.torch.fingerprint import Fingerprinter, parameter_probes
from backends.torch.grouped import response_logprobs
from backends.torch.host_copy import HostCopier
from backends.torch.model import Decoder
from backends.torch.precision import MasterWeights, StreamedParking
from backends.torch.schedule import lr_factor
from backends.torch.section import TrainerOptions
from backends.torch.state_file import TRAINER_FILE, StateSnapshot, load_state, nonfinite_on_device, save_state
from pipeline.algorithms.config import Algorithm
from pipeline.algorithms.update import Chunk, run_update
from pipeline.contracts.backend_input import Batching, Optimizer
from pipeline.contracts.errors import NonFiniteState, RecipeError
from pipeline.contracts.messages import TrainGroup, TrainSample


@dataclass(frozen=True)
class _Inputs:
    """A micro-batch as the torch model takes it: each group's prompt once, and for each
    response the index of its prompt."""

    prompts: list[tuple[int, ...]]
    owner: list[int]
    responses: list[tuple[int, ...]]


def _computed(inputs: _Inputs) -> int:
    """Tokens a micro-batch's forward computes: its prompts left-padded to the widest, and each
    response's inputs (all its tokens but the last), packed."""
    return len(inputs.prompts) * max(len(p) for p in inputs.prompts) + sum(
        len(r) - 1 for r in inputs.responses
    )


class TorchTrainer:
    def __init__(
        self,
        model: Decoder,
        *,
        algorithm: Algorithm,
        optimizer: Optimizer,
        batching: Batching,
        options: TrainerOptions | None = None,
        temperature: float,
        seed: int,
        reference: Decoder | None = None,
        compute: ComputeThread | None = None,
        fingerprints: bool = False,
        ranks: RankGroup | None = None,
    ) -> None:
        """`optimizer`, `batching`, `options`: the backend input's (`backends/input.py`);
        `ranks`: this trainer's data-parallel ranks (None: it is the only one)."""
        options = options or TrainerOptions()
        updates_per_step = batching.updates_per_step
        self.model = model
        # What `fingerprint` returns: the weights published by the last step (or load).
        probes = parameter_probes(model.named_parameters()) if fingerprints else None
        self._fingerprinter = Fingerprinter(probes) if probes is not None else None
        self._published: dict[str, int] | None = None
        self.compiled = options.compile
        self.checkpointed = options.activation_checkpointing
        self.compute = compute or ComputeThread("trainer")
        self.algorithm = algorithm
        self.grad_clip = optimizer.grad_clip
        self.micro_batch_samples = batching.micro_batch_samples
        self.micro_batch_tokens = batching.micro_batch_tokens
        self.updates_per_step = updates_per_step
        # Greedy generation reports temperature-1 logprobs, so recompute at 1 then as well.
        self.temperature = temperature if temperature > 0 else 1.0
        self.reference = reference
        self.device = next(model.parameters()).device
        low_precision = any(p.dtype != torch.float32 for p in model.parameters())
        # Under data parallelism each rank steps (and keeps the optimizer state of) the
        # parameters it owns; the others arrive from their owners after each update.
        self.ranks = ranks
        self.owner: list[int] | None = None
        owned = list(model.parameters())
        if ranks is not None:
            self.owner = owners(owned, ranks.size)
            owned = [p for p, owner in zip(owned, self.owner, strict=True) if owner == ranks.rank]
        # bf16 weights step through float32 masters (see backends/torch/precision.py).
        self.master = MasterWeights(owned) if options.master_weights and low_precision else None
        params = self.master.master if self.master is not None else owned
        # The fused kernel on CPU too: one call a parameter instead of a dozen ops (0.2 vs 1 ms a
        # step for the CPU quickstart's model).
        self.optimizer = torch.optim.AdamW(
            params, lr=optimizer.lr, betas=optimizer.betas, weight_decay=optimizer.weight_decay, fused=True
        )
        # Off the device between steps (colocated: while the engine generates) and streamed
        # through it chunk by chunk during the optimizer step, when asked; parked from the
        # start, so the first generation has the room too.
        self.parking: StreamedParking | None = None
        if options.offload_optimizer:
            self.parking = StreamedParking(self._param_chunks(), self._optimizer_tensors)
            self.parking.park_all()
            self.parking.take_seconds()  # not the first step's copies
        total_updates = max(1, optimizer.total_steps * updates_per_step)
        warmup_updates = optimizer.warmup_steps * updates_per_step

        def factor(update: int) -> float:
            return lr_factor(
                update,
                warmup_updates=warmup_updates,
                total_updates=total_updates,
                schedule=optimizer.schedule,
                min_lr_ratio=optimizer.min_lr_ratio,
            )

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
        self.generator = torch.Generator().manual_seed(seed)
        self.skipped_steps = 0
        self.completed_steps = 0
        self._reserved = False  # the snapshot buffer (`_host`) reserved
        self._computed_tokens = 0  # this step's, by `micro_batches`

    async def train_step(self, groups: Sequence[TrainGroup]) -> dict[str, float]:
        return await self.compute.run(self._train_step, list(groups))

    @property
    def has_reference(self) -> bool:
        return self.reference is not None

    def micro_batches(self, groups: list[TrainGroup]) -> list[Chunk]:
        """One minibatch's micro-batches: its groups in order, whole, each group's prompt
        computed once per micro-batch and its responses packed at their own lengths
        (`grouped.response_logprobs`: no padding). A micro-batch holds at most
        `micro_batch_samples` samples and, with `micro_batch_tokens`, at most that many computed
        tokens (its prompts once each, plus its responses' tokens); a group over the budget is
        split into runs of its samples, each computing the prompt again, and a sample over it
        alone still makes a micro-batch of its own.
        """
        budget = self.micro_batch_tokens
        pieces: list[tuple[TrainGroup, list[TrainSample]]] = []
        for group in groups:
            prompt = len(group.prompt_tokens)
            run: list[TrainSample] = []
            for sample in group.samples:
                cost = prompt + sum(len(s.tokens) for s in run) + len(sample.tokens)
                if run and budget and cost > budget:
                    pieces.append((group, run))
                    run = []
                run.append(sample)
            pieces.append((group, run))
        chunks: list[list[tuple[TrainGroup, list[TrainSample]]]] = []
        current: list[tuple[TrainGroup, list[TrainSample]]] = []
        rows = tokens = 0
        for group, samples in pieces:
            new_prompt = all(g is not group for g, _ in current)
            cost = (len(group.prompt_tokens) if new_prompt else 0) + sum(len(s.tokens) for s in samples)
            over_tokens = budget and tokens + cost > budget
            if current and (rows + len(samples) > self.micro_batch_samples or over_tokens):
                chunks.append(current)
                current, rows, tokens = [], 0, 0
                cost = len(group.prompt_tokens) + sum(len(s.tokens) for s in samples)
            current.append((group, samples))
            rows, tokens = rows + len(samples), tokens + cost
        chunks.append(current)
        made = [self._chunk(c) for c in chunks]
        self._computed_tokens += sum(_computed(chunk.inputs) for chunk in made)
        return made

    def _chunk(self, pieces: list[tuple[TrainGroup, list[TrainSample]]]) -> Chunk:
        """One micro-batch: samples of one or more groups, each group's prompt stored once."""
        groups = {id(group): group for group, _ in pieces}  # in order, each once
        index = {key: i for i, key in enumerate(groups)}
        samples = [s for _, part in pieces for s in part]
        inputs = _Inputs(
            prompts=[group.prompt_tokens for group in groups.values()],
            owner=[index[id(group)] for group, part in pieces for _ in part],
            responses=[s.tokens for s in samples],
        )
        return Chunk.of(samples, inputs, self.device)

    def logprobs(self, chunk: Chunk, *, reference: bool = False) -> torch.Tensor:
        model = self.reference if reference else self.model
        assert model is not None
        inputs: _Inputs = chunk.inputs
        return response_logprobs(
            model,
            inputs.prompts,
            inputs.owner,
            inputs.responses,
            self.temperature,
            compiled=self.compiled,
            checkpointed=self.checkpointed,
        )[0]

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def _train_step(self, groups: list[TrainGroup]) -> dict[str, float]:
        self.model.train()
        self._computed_tokens = 0
        compiled = compiled_graphs()
        metrics, skipped = run_update(
            self,
            groups,
            algorithm=self.algorithm,
            updates_per_step=self.updates_per_step,
            parallel=self.ranks.for_update() if self.ranks is not None else None,
        )
        # What one pass over the batch pushes through the layers (beside train/tokens, the
        # responses' own): the prompts once per micro-batch, padded to the longest there.
        computed = torch.tensor(float(self._computed_tokens), dtype=torch.float64, device=self.device)
        if self.ranks is not None:  # the whole step's: every rank's micro-batches
            self.ranks.all_sum(computed)
        metrics["train/computed_tokens"] = float(computed)
        metrics["train/compiled_graphs"] = float(compiled_graphs() - compiled)
        self.skipped_steps += skipped
        metrics["train/skipped_steps"] = float(self.skipped_steps)
        if self.parking is not None:
            moved = self.parking.take_seconds()
            metrics["timing/optimizer_reload_s"] = moved["reload"]
            metrics["timing/optimizer_offload_s"] = moved["offload"]
            metrics["train/offloaded_gb"] = self.parking.bytes / 1e9
        self.completed_steps += 1
        self._take_fingerprint()
        if not self._reserved:  # the state's size is known once the optimizer has its moments
            self._reserved = True
            self._host.reserve(self.state())  # the first snapshot then finds its buffer ready
        return metrics

    def _take_fingerprint(self) -> None:
        if self._fingerprinter is not None:
            self._published = self._fingerprinter()

    def fingerprint(self) -> dict[str, int] | None:
        return self._published

    def served_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """The weights an engine's `Decoder` takes: the model's own parameters."""
        return list(self.model.named_parameters())

    def apply(self, *, finite_loss: bool) -> float | None:
        """Clip and apply the accumulated gradients, then step the schedule; the gradient norm,
        or None when the update was skipped (the schedule stays where it was)."""
        grad_norm = self._apply(finite_loss)
        if grad_norm is not None:  # the schedule counts applied updates, as megatron-LM's does
            self.scheduler.step()
        return grad_norm

    def _apply(self, finite_loss: bool) -> float | None:
        if self.ranks is not None:
            sum_gradients(list(self.model.parameters()), self.ranks)  # the whole minibatch's
        if self.master is None:
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip))
        elif self.ranks is None:
            norm = self.master.grad_norm()
        else:  # the masters hold this rank's parameters only: the norm is of them all
            norm = grad_norm(list(self.model.parameters()))
        return self._step(finite_loss, norm)

    def _step(self, finite_loss: bool, grad_norm: float) -> float | None:
        if not (finite_loss and math.isfinite(grad_norm)):
            self.model.zero_grad(set_to_none=True)
            return None
        # One chunk at a time (its state streamed in and out when parked); AdamW skips
        # parameters without a gradient.
        scale = min(1.0, self.grad_clip / (grad_norm + 1e-6))
        for index, chunk in enumerate(self._param_chunks()):
            if self.parking is not None:
                self.parking.restore(index)
            if self.master is not None:
                self.master.load_grads(scale, chunk)
            self.optimizer.step()
            if self.master is not None:
                self.master.publish(chunk)
            if self.parking is not None:
                self.parking.park(index)
        if self.ranks is not None:
            assert self.owner is not None  # set with ranks
            share_owned(list(self.model.parameters()), self.owner, self.ranks)
        return grad_norm

    def _param_chunks(self) -> list[list[int]]:
        """Indices of the optimizer's parameters, stepped one list at a time: the master
        weights' chunks, or all at once without them (the model's grads are clipped in place)."""
        if self.master is not None:
            return self.master.chunks
        return [list(range(len(self.optimizer.param_groups[0]["params"])))]

    def _optimizer_tensors(self, chunk: list[int]) -> list[torch.Tensor]:
        """What parking moves for the parameters `chunk` indexes: their master weights and
        optimizer moments (the model's own weights stay: the engine may read them)."""
        params = self.optimizer.param_groups[0]["params"]
        tensors: list[torch.Tensor] = []
        if self.master is not None:
            tensors.extend(self.master.master[i] for i in chunk)
        for i in chunk:
            state = self.optimizer.state.get(params[i], {})
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        return tensors

    def close(self) -> None:
        """Stop the compute thread (after its current call)."""
        self.compute.close()

    @property
    def state_file(self) -> str:
        """This rank's file of a checkpoint: `trainer.pt` (the model, read by `export`, and rank
        0's optimizer shard), `trainer.rank<r>.pt` for data-parallel rank r > 0."""
        rank = self.ranks.rank if self.ranks is not None else 0
        return TRAINER_FILE if rank == 0 else f"trainer.rank{rank}.pt"

    def save(self, directory: Path) -> None:
        save_state(directory / self.state_file, self.state())

    def snapshot(self, directory: Path) -> StateSnapshot:
        """`save`'s state copied to host memory now, on the compute thread (between steps: the
        gate calls it after the step), written into `directory` by the snapshot's `write()`
        later (`pipeline.protocols.Snapshotting`). The host buffer is reused by every snapshot
        (pinned memory on GPU), reserved after the first step. The state is verified finite
        here, where it lives (`NonFiniteState`; on a GPU one sum a tensor and one
        synchronization), so the write's thread need not walk the host copy."""
        path = directory / self.state_file

        def take() -> StateSnapshot:
            state = self.state()
            where = nonfinite_on_device(state)
            if where is not None:
                raise NonFiniteState(f"{path.name} would hold non-finite values at {where}")
            return StateSnapshot(path, self._host.copy(state), checked=True)

        return self.compute.call(take)

    @functools.cached_property
    def _host(self) -> HostCopier:
        return HostCopier()

    def load(self, directory: Path) -> None:
        state = load_state(directory / self.state_file)
        saved = sum(len(group["params"]) for group in state["optimizer"]["param_groups"])
        if saved != len(self.optimizer.param_groups[0]["params"]):
            # Written before q/k/v and gate/up became one parameter each (or for another model).
            raise RecipeError(
                f"checkpoint {directory}: its optimizer state holds {saved} parameters, the model "
                f"has {len(self.optimizer.param_groups[0]['params'])} (checkpoints written before "
                "the fused q/k/v and gate/up projections do not resume; `python -m pipeline "
                "export` gives its model files for model.path)"
            )
        self.load_state(state)

    def state(self) -> dict[str, Any]:
        optimizer = self.optimizer.state_dict()
        if self.parking is not None:  # the host copies of whatever is parked
            optimizer["state"] = {
                index: {
                    k: self.parking.host_copy(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()
                }
                for index, s in optimizer["state"].items()
            }
        master = None
        if self.master is not None:
            master = [(self.parking.host_copy(m) if self.parking else m).detach() for m in self.master.master]
        return {
            "model": self.model.state_dict(),
            "master": master,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "generator": self.generator.get_state(),
            "skipped_steps": self.skipped_steps,
            "completed_steps": self.completed_steps,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        if self.parking is not None:
            self.parking.restore_all()  # loading replaces the optimizer's moments
            self.parking.forget()
        self.model.load_state_dict(state["model"])
        if self.master is not None:
            if state.get("master") is not None:
                with torch.no_grad():
                    for m, saved in zip(self.master.master, state["master"], strict=True):
                        m.copy_(saved)
            else:  # a checkpoint written without master weights
                self.master.reload_from_model()
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["generator"])
        self.skipped_steps = int(state["skipped_steps"])
        self.completed_steps = int(state["completed_steps"])
        if self.parking is not None:  # the loaded state leaves the device until the next step
            self.parking.park_all()
            self.parking.take_seconds()
        self._take_fingerprint()
