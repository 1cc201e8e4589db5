"""The optimizer step of the megatron trainer: one interface, a CPU and a GPU implementation.

Both clip the summed gradients to `grad_clip` by their global norm (scale min(1, clip / (norm +
1e-6)), as the torch trainer does), skip the update when that norm is not finite, and take the
learning rate for each update from the caller (the trainer owns the schedule).

  * `TorchAdamW` (CPU): plain `torch.optim.AdamW` on the model's parameters (megatron's own
    optimizer and its 0.19 DDP wrapper hard-code CUDA). Under tensor parallelism the norm sums
    each sharded parameter's squares over the ranks and counts replicated ones (norms) once;
    under data parallelism the gradients are first summed over the data-parallel group (the
    optimizer state is replicated there, not sharded).
  * `MegatronAdam` (GPU): the model inside megatron's `DistributedDataParallel` (gradients in
    float32 buffers) and its distributed optimizer: bf16 weights stepped through float32
    masters, optimizer state sharded over data-parallel ranks. The data-parallel ranks'
    gradients are summed, not averaged: the update loop normalises the loss by the whole
    step's counts already. At one data-parallel rank its save state is views of the live
    masters and moments (`param_state`), not megatron's gathered host copies.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

from backends.megatron import param_state


class Step(Protocol):
    model: torch.nn.Module  # what the forward pass calls (possibly a wrapper of the GPTModel)

    def zero_grad(self) -> None: ...

    def step(self, lr: float) -> float:
        """Clip and apply the accumulated gradients at `lr`; the global gradient norm (the
        update is skipped, and the gradients dropped, when it is not finite)."""
        ...

    def sharded_state_dict(self, model_state: Any, *, loading: bool) -> Any:
        """The optimizer's state as `dist_checkpointing` shards, for a save or (``loading``) as
        the template a load fills."""
        ...

    def load_state_dict(self, state: Any) -> None: ...


class TorchAdamW:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
        grad_clip: float,
    ) -> None:
        self.model = model
        self.grad_clip = grad_clip
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=betas, weight_decay=weight_decay)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _grad_norm(self) -> float:
        squares = torch.zeros((), dtype=torch.float32, device=self.params[0].device)
        for p in self.params:
            if p.grad is not None and param_is_not_tensor_parallel_duplicate(p):
                squares += p.grad.float().square().sum()
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(squares, group=parallel_state.get_tensor_model_parallel_group())
        return math.sqrt(float(squares))

    @torch.no_grad()
    def step(self, lr: float) -> float:
        if parallel_state.get_data_parallel_world_size() > 1:
            group = parallel_state.get_data_parallel_group()
            for p in self.params:
                if p.grad is None:  # a rank that trained no group of this minibatch adds zeros
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=group)
        grad_norm = self._grad_norm()
        if not math.isfinite(grad_norm):
            self.zero_grad()
            return grad_norm
        scale = min(1.0, self.grad_clip / (grad_norm + 1e-6))
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(scale)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return grad_norm

    def sharded_state_dict(self, model_state: Any, *, loading: bool) -> Any:
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        # A load fills a template of the state's tensors: a trainer yet to step has none, so it
        # gets AdamW's initial state (zero moments at step 0: the same updates as none).
        for p in self.params:
            if not self.optimizer.state[p]:
                self.optimizer.state[p].update(
                    step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p)
                )
        state = self.optimizer.state_dict()
        state["state"] = {i: dict(s) for i, s in state["state"].items()}  # not the live per-parameter dicts
        # Adam's per-parameter step counts are scalars, which have no shards: they travel whole,
        # beside the sharded moments, as a common (replicated) value.
        steps = {i: s.pop("step") for i, s in state["state"].items()}
        optim_state_to_sharding_state(state, get_param_id_to_sharded_param_map(model_state, self.params))
        state["steps"] = steps
        return state

    def load_state_dict(self, state: Any) -> None:
        for i, step in state.pop("steps").items():
            state["state"][i]["step"] = step
        self.optimizer.load_state_dict(state)


class MegatronAdam:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
        grad_clip: float,
    ) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
        config: Any = model.config
        # Sum the data-parallel ranks' gradients (megatron's scaling for losses already divided
        # by the global token count; the default averages them). The flag's other readers are
        # megatron's training schedules, which this trainer does not use.
        config.calculate_per_token_loss = True
        self.model = DistributedDataParallel(config, ddp, model)
        self.grad_clip = grad_clip
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=lr,
                weight_decay=weight_decay,
                adam_beta1=betas[0],
                adam_beta2=betas[1],
                bf16=config.bf16,
                params_dtype=config.params_dtype,
                use_distributed_optimizer=True,
                clip_grad=grad_clip,
            ),
            [self.model],
        )

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    @torch.no_grad()
    def step(self, lr: float) -> float:
        self.model.finish_grad_sync()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.clip_grad_norm(self.grad_clip))
        if math.isfinite(grad_norm):
            self.optimizer.step_with_ready_grads()
        self.zero_grad()
        return grad_norm

    def sharded_state_dict(self, model_state: Any, *, loading: bool) -> Any:
        if loading:
            self._fresh_state()
        elif param_state.applies(self.optimizer):
            # One data-parallel rank: the same state as views of the live tensors, not gathered
            # into host copies (see `param_state`).
            return param_state.live(self.optimizer, model_state)
        # In parameter space (each parameter's moments whole, gathered on save): a checkpoint
        # that loads at any tensor-parallel or data-parallel size. 0.19's default,
        # "fully_sharded_model_space", refuses to save ("ShardedTensor.flattened_range is not
        # supported").
        return self.optimizer.sharded_state_dict(
            model_state, is_loading=loading, metadata={"distrib_optim_sharding_type": param_state.FORMAT}
        )

    def load_state_dict(self, state: Any) -> None:
        """0.19 without Apex or TransformerEngine: loading "fully_reshardable" parameter state
        copies into every tensor of each master's Adam state, its "step" too, which the
        checkpoint's parameter state does not hold (KeyError: 'step'; megatron restores the step
        counts itself, from the param groups). So the rest loads first, then the parameter state
        with the step counts held as plain numbers, which that copy skips, then as tensors again,
        each master its own: megatron's load hands every master one shared step tensor, which
        torch's Adam then advances once per master at each update (its bias correction then
        computed at a step count near the number of masters, and a resumed run off its course)."""
        chained = self.optimizer.chained_optimizers
        parts = [state] if len(chained) == 1 else [part for _, part in sorted(state.items())]
        for inner, part in zip(chained, parts, strict=True):
            saved = part.pop("param_state", None)
            assert part.pop("param_state_sharding_type", "fully_reshardable") == "fully_reshardable"
            inner.load_state_dict(part)
            adam = inner.optimizer.state
            steps = {p: s["step"] for p, s in adam.items() if "step" in s}
            try:
                if saved is not None:
                    for p, step in steps.items():
                        adam[p]["step"] = float(step)
                    inner.load_parameter_state_from_fully_reshardable(saved)
            finally:
                for p, step in steps.items():
                    adam[p]["step"] = step.detach().clone()

    def _fresh_state(self) -> None:
        """A load's template needs the state's tensors, which torch's Adam makes only at its
        first step: without Apex or TransformerEngine, 0.19's distributed optimizer asserts one
        step count over its state, and a trainer yet to step has none. Give each float32 master
        Adam's initial state (zero moments at step 0), as `TorchAdamW` does; the load replaces it."""
        for inner in self.optimizer.chained_optimizers:
            adam = inner.optimizer
            for group in adam.param_groups:
                for p in group["params"]:
                    if not adam.state[p]:
                        zeros = torch.zeros_like
                        adam.state[p].update(step=torch.tensor(0.0), exp_avg=zeros(p), exp_avg_sq=zeros(p))
