"""Environments for the environment-worker tests (`test_ray_environments.py`), in a module of
their own that imports the contracts only: each worker actor imports it to build them."""

from __future__ import annotations

import time
from pathlib import Path

import anyio

from pipeline.contracts.environments import Observation, Turn
from pipeline.contracts.messages import Prompt


class Raises:
    async def start(self, prompt: Prompt) -> Observation:
        return Observation(text="?")

    async def step(self, turn: Turn) -> Observation:
        raise KeyError("board")


class Malformed(Raises):
    async def step(self, turn: Turn) -> Observation:
        return {"text": "<"}  # type: ignore[return-value]


class Stalls(Raises):
    """Its step never answers where the prompt's answer is `stall` (appending `stalled` to the
    file `log` as it begins, `cancelled` when it is cancelled, where `log` is given); else it
    ends the episode won."""

    def __init__(self, log: str = "") -> None:
        self.log = log
        self.stall = False

    async def start(self, prompt: Prompt) -> Observation:
        self.stall = prompt.answer == "stall"
        return Observation(text="?")

    async def step(self, turn: Turn) -> Observation:
        if self.stall:
            self._note("stalled")
            try:
                await anyio.sleep_forever()
            finally:
                self._note("cancelled")
        return Observation(reward=1.0, done=True)

    def _note(self, line: str) -> None:
        if self.log:
            with Path(self.log).open("a") as log:
                log.write(line + "\n")


class Blocks(Raises):
    """Where the prompt's answer is `block`, its step holds its worker's event loop for
    `seconds` in a synchronous sleep (appending `blocking` to the file `log` as it begins); else
    it ends the episode won."""

    def __init__(self, log: str, seconds: float) -> None:
        self.log = log
        self.seconds = seconds
        self.block = False

    async def start(self, prompt: Prompt) -> Observation:
        self.block = prompt.answer == "block"
        return Observation(text="?")

    async def step(self, turn: Turn) -> Observation:
        if self.block:
            with Path(self.log).open("a") as log:
                log.write("blocking\n")
            time.sleep(self.seconds)
        return Observation(reward=1.0, done=True)
