"""The torch generation engine behind the pipeline's `Engine` protocol.

Concurrent `generate(prompt, n)` calls (one per group) are gathered into one batched
`Sampler.generate` of their requests that runs in a worker thread: whichever caller finds no
batch running leads, collects every request queued by then, and runs batches until its own
request is answered; then the next waiting caller leads. The sampler call is shielded from
cancellation (a thread cannot be interrupted), so one caller's deadline never orphans the
others.

Colocated (`shared=True`) the engine samples from the trainer's own parameter tensors: it must
stand down for training (its KV cache's memory is released) and waking it maps the cache again
and serves the new weights at once.
Otherwise it holds its own copy, keeps serving while the trainer works, and `refit` copies the
new weights in between two batches. A trainer whose weights are not a `Decoder` (the megatron
backend) gives `refresh_weights`, which brings the engine's model up to date from them: it runs
on the engine's thread at each wake and in each refit (instead of the copy from `source`),
before the new weights are served and fingerprinted.

Each request's own arguments are checked before it joins a batch: one that the model cannot
serve (a prompt too long for learned position embeddings) is refused with `RequestRejected`
instead of failing the batched call of every request gathered with it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import torch

from backends.torch.compute import ComputeThread
from backends.torch.fingerprint import Fingerprinter, parameter_probes
from backends.torch.model import Decoder
from backends.torch.sampler import Sampler
from backends.torch.sampling import check_arguments, check_prompts
from backends.torch.state_file import ENGINE_FILE, load_state, save_state
from pipeline.errors import RequestRejected
from pipeline.messages import Completion


class _Request:
    __slots__ = ("done", "greedy", "n", "prompt", "result")

    def __init__(self, prompt: Sequence[int], n: int, greedy: bool) -> None:
        self.prompt = list(prompt)
        self.n = n
        self.greedy = greedy
        self.result: list[Completion] | BaseException | None = None
        self.done = False


class TorchEngine:
    def __init__(
        self,
        sampler: Sampler,
        *,
        shared: bool,
        source: Decoder,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        stop_token_ids: Sequence[int],
        seed: int,
        compute: ComputeThread | None = None,
        fingerprints: bool = False,
        refresh_weights: Callable[[], None] | None = None,
    ) -> None:
        self.sampler = sampler
        self.fingerprints = fingerprints
        self.refresh_weights = refresh_weights
        self._fingerprinter: Fingerprinter | None = None
        self._served: dict[str, int] | None = None
        self.compute = compute or ComputeThread("engine")
        self.blocks_training = shared
        self.wake_carries_weights = shared
        self.source = source
        check_arguments([], max_new_tokens, temperature, top_p)  # once; prompts per request
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.stop_token_ids = tuple(stop_token_ids)
        self.generator = torch.Generator(device=sampler.device).manual_seed(seed)
        self._queue: list[_Request] = []
        self._leading = False
        self._changed = anyio.Event()
        self._weights = anyio.Lock()
        self.calls = 0

    async def generate(
        self, prompt_tokens: Sequence[int], n: int, *, greedy: bool = False
    ) -> list[Completion]:
        try:  # here, alone: in a batched call one bad prompt would fail all the others
            check_prompts(
                [list(prompt_tokens)],
                self.max_new_tokens,
                max_positions=self.sampler.model.config.position_limit,
            )
        except ValueError as error:
            raise RequestRejected(str(error)) from None
        request = _Request(prompt_tokens, n, greedy)
        self._queue.append(request)
        try:
            while not request.done:
                if self._leading:
                    await self._changed.wait()
                    continue
                self._leading = True
                try:
                    await self._gather()
                    while not request.done:
                        await self._run_batch()
                finally:
                    self._leading = False
                    self._notify()
        finally:
            if request in self._queue:  # cancelled while queued: nobody should sample for it
                self._queue.remove(request)
        if isinstance(request.result, BaseException):
            raise request.result
        assert request.result is not None
        return request.result

    async def _gather(self) -> None:
        """Yield to the event loop until no new request arrived for two rounds, so the groups
        started together (a batch's prompts) are sampled in one call, not the first alone."""
        quiet, seen = 0, len(self._queue)
        while quiet < 2:
            await anyio.lowlevel.checkpoint()
            quiet = quiet + 1 if len(self._queue) == seen else 0
            seen = len(self._queue)

    async def _run_batch(self) -> None:
        greedy = self._queue[0].greedy
        batch = [r for r in self._queue if r.greedy == greedy]
        self._queue = [r for r in self._queue if r.greedy != greedy]
        with anyio.CancelScope(shield=True):
            async with self._weights:
                try:
                    results = await self.compute.run(self._sample, batch)
                except Exception as error:
                    for request in batch:
                        request.result, request.done = error, True
                    return
        for request, completions in zip(batch, results, strict=True):
            request.result, request.done = completions, True
        self._notify()

    def _sample(self, batch: list[_Request]) -> list[list[Completion]]:
        self.calls += 1
        return self.sampler.generate(
            [(r.prompt, r.n) for r in batch],
            max_new_tokens=self.max_new_tokens,
            temperature=0.0 if batch[0].greedy else self.temperature,
            top_p=self.top_p,
            stop_token_ids=self.stop_token_ids,
            generator=self.generator,
        )

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def stand_down(self) -> None:
        await self.compute.run(self.sampler.release)

    async def wake(self) -> None:
        """No weights to load: colocated, the engine reads the trainer's tensors. The sampler
        maps its KV cache's memory again."""
        await self.compute.run(self._wake)

    def _wake(self) -> None:
        if self.refresh_weights is not None:
            self.refresh_weights()
        self.sampler.wake()
        self._take_fingerprint()

    async def refit(self) -> None:
        async with self._weights:
            await self.compute.run(self._copy_weights)

    @torch.no_grad()
    def _copy_weights(self) -> None:
        if self.refresh_weights is not None:
            self.refresh_weights()
        elif self.sampler.model is not self.source:
            for target, value in zip(self.sampler.model.parameters(), self.source.parameters(), strict=True):
                target.copy_(value)
        self._take_fingerprint()

    async def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy `weights` (every parameter, by name) into the served model between two batches:
        the refit of an engine whose trainer is in another process."""
        async with self._weights:
            await self.compute.run(self._load_weights, weights)

    @torch.no_grad()
    def _load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        for name, target in self.sampler.model.named_parameters():
            target.copy_(weights[name])
        self._take_fingerprint()

    def _take_fingerprint(self) -> None:
        """What the sampler serves now (`fingerprint`), when asked for at construction: the
        parameters of its model, which it reads where they are."""
        if not self.fingerprints:
            return
        if self._fingerprinter is None:
            self._fingerprinter = Fingerprinter(parameter_probes(self.sampler.model.named_parameters()))
        self._served = self._fingerprinter()

    def fingerprint(self) -> dict[str, int] | None:
        return self._served

    def save(self, directory: Path) -> None:
        save_state(directory / ENGINE_FILE, self.state())

    def load(self, directory: Path) -> None:
        self.load_state(load_state(directory / ENGINE_FILE))

    def state(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore the sampling RNG; weights come from the trainer (shared, or a refit)."""
        self.generator.set_state(state["generator"])
        self._copy_weights()

    def close(self) -> None:
        """Stop the compute thread (after its current call)."""
        self.compute.close()

    def memory_in_use(self) -> int | None:
        return self.sampler.cache_bytes()
