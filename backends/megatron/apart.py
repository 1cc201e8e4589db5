"""megatron's inference engine apart from the trainer (`rollout.engine: megatron`, `colocated:
false`): the engine serves a `GPTModel` of its own, the trainer's copied into it.

`EngineCopy(trainer_model, config, fingerprints=...)` builds a second `GPTModel` of the same
shape on the trainer's device (no gradients, eval mode; on one GPU the two sit side by side)
and copies the trainer's parameters into it, tensor by tensor by name: the two are built alike,
so the layouts match and nothing is resharded. `refresh()` copies them again; the engine thread
calls it at each refit, once no request is in flight (`MegatronInference`), so nothing reads the
copy while it changes. On CUDA it first waits for the device (the trainer's step ran on its own
thread and stream) and after the copy for its own stream (the trainer's next step writes the
tensors it read). With `fingerprints` (`async_rl.handoff_checks`) `fingerprint()` is that of the
copy as the engine's `Decoder` names and lays out its weights (`reshard.served`): what the
trainer publishes (`MegatronTrainer.fingerprint`), so the gate checks each refit delivered the
step's weights.

One process, one tensor-parallel rank: `train.tensor_parallel` above 1 needs Ray, which this
engine is not built for (`rules.check_engine`).
"""

from __future__ import annotations

from typing import Any

import torch

from backends.megatron import reshard
from backends.megatron.model import build_gpt_model
from backends.torch.config import ModelConfig
from backends.torch.fingerprint import Fingerprinter, parameter_probes


class EngineCopy:
    def __init__(self, trainer_model: Any, config: ModelConfig, *, fingerprints: bool) -> None:
        self.source = trainer_model
        self.config = config
        self.fingerprints = fingerprints
        first = next(trainer_model.parameters())
        self.device = first.device
        self.model = build_gpt_model(config, dtype=first.dtype, device=self.device)
        self.model.requires_grad_(False)
        self.model.eval()
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the trainer's parameters into the engine's model (module docstring)."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        source = dict(self.source.named_parameters())
        for name, target in self.model.named_parameters():
            target.copy_(source[name])
        if cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def fingerprint(self) -> dict[str, int] | None:
        if not self.fingerprints:
            return None
        return Fingerprinter(parameter_probes(reshard.served(self.model, self.config)))()
