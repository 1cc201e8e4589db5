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

On Ray the engine apart is a replica actor of its own (`ReplicaCopy`): its model is built from
the model section as the trainer's first weights are, and each refit copies in the weights the
replica was sent (the trainer's package, by the engine `Decoder`'s names, which a `Decoder`
shell on the meta device names as Hugging Face's, and `layout.load_hf` lays out as megatron's),
again once no request is in flight.

One tensor-parallel rank: the engine runs one rank's forward alone (`rules.check_engine`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from backends.megatron import layout, reshard
from backends.megatron.model import build_gpt_model
from backends.torch.config import ModelConfig
from backends.torch.fingerprint import Fingerprinter, parameter_probes
from backends.torch.model import Decoder


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


class ReplicaCopy:
    """The model of a Ray engine replica apart from the trainer (module docstring). `like`:
    the parameters a package must hold, as the engine `Decoder` names and shapes them (on the
    meta device: only their shapes and dtypes are compared); `receive` keeps the weights the
    next `refresh` copies in."""

    def __init__(self, model: Any, config: ModelConfig, *, fingerprints: bool) -> None:
        self.model = model
        self.config = config
        self.fingerprints = fingerprints
        self.device = next(model.parameters()).device
        self.model.requires_grad_(False)
        self.model.eval()
        self.like = [(name, t.to("meta")) for name, t in reshard.served(model, config)]
        self._pending: Mapping[str, torch.Tensor] | None = None

    def receive(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._pending = weights

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the weights received last into the model (nothing when none arrived since: a
        resume's refit before the trainer's weights are sent)."""
        weights, self._pending = self._pending, None
        if weights is None:
            return
        # A shell names them as Hugging Face's (its state dict); it holds them (CUDA IPC handles
        # of the trainer's tensors, perhaps) only until this returns.
        with torch.device("meta"):
            shell = Decoder(self.config)
        for name, tensor in weights.items():
            owner, _, leaf = name.rpartition(".")
            setattr(shell.get_submodule(owner), leaf, torch.nn.Parameter(tensor, requires_grad=False))
        layout.load_hf(self.model, shell.state_dict(), self.config)
        if self.device.type == "cuda":
            # The copies have read their sources (by CUDA IPC, the trainer's own tensors) before
            # the refit answers and the trainer's next step may write them.
            torch.cuda.current_stream(self.device).synchronize()

    def fingerprint(self) -> dict[str, int] | None:
        if not self.fingerprints:
            return None
        return Fingerprinter(parameter_probes(reshard.served(self.model, self.config)))()
